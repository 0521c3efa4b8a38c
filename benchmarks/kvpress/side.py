"""The kvpress half of ``benchmarks/kvpress/vs_kvpress.py`` (started by ``benchmarks.kvpress.common.KvpressSide``);
runs INSIDE the kvpress virtual environment.

kvpress 0.5.5 needs transformers 5.2 (it reads ``cache_position``, removed in transformers 5.3+),
so it cannot share the project's venv. ``vs_kvpress.py`` starts this script with the kvpress venv's
Python and talks to it with one JSON object per line: requests on stdin, replies on stdout
(``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``); bulky results (kept indices, scores)
go into a ``torch.save`` file whose path is in the reply. Logs go to stderr. Nothing from the
project is imported here: the two sides share only the model folder and token ids.

Ops:

* ``hello``: versions and thread count.
* ``kept``: prefill ``ids`` under a press and return, per layer and KV head, the kept positions.
  Uniform presses (``SnapKVPress``, ``CriticalKVPress``) prune with ``scores.topk(n_kept)``
  (``ScorerPress.compress``); we wrap the press's ``score`` and repeat that exact ``topk`` on the
  captured scores. Head-wise presses (``AdaKVPress``, ``CriticalAdaKVPress``) only mask: the
  kept positions are the complement of ``module.masked_key_indices``. Base SnapKV scores are
  captured too (to compare score values with ours).
* ``doc``: one document as ``KVPressTextGenerationPipeline._forward`` runs it (prefill of the
  context with the press on ``model.model``, then ``generate_answer``: question prefill + greedy
  decode), EOS disabled so exactly ``max_new_tokens`` tokens are produced. Reports wall times,
  time inside the press hooks (compression) and inside ``vwl1norm`` (the CriticalKV norms), bytes
  of K/V tensors held by the cache after prefill, kept entries, peak RSS above the start.
* ``batch_try``: prefill a batch of equal-length rows with a press to see whether it works and
  whether each row's selection equals that row's one-by-one selection.
* ``quit``.

Usage (by vs_kvpress.py): <kvpress-venv>/bin/python -m benchmarks.kvpress.side --model DIR [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

PROTOCOL_OUT = sys.stdout
sys.stdout = sys.stderr  # anything printed by libraries must not corrupt the protocol

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

import kvpress  # noqa: E402
from kvpress import KVPressTextGenerationPipeline  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402

from benchmarks.kvpress.side_tools import (  # noqa: E402
    HEADWISE,
    base_press,
    cache_bytes,
    capture_pruning,
    dist_version,
    make_press,
    masked_to_kept,
    null,
    recording,
    reset_peak,
    status_bytes,
    timed_press,
)


class Side:
    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        self.model_dir = model_dir
        self.models: dict[str, torch.nn.Module] = {}
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model(dtype)
        self.out_dir = Path(tempfile.mkdtemp(prefix="kvpress-side-"))
        self._pipes: dict[int, KVPressTextGenerationPipeline] = {}

    def model(self, dtype: str):
        if dtype not in self.models:
            m = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype)).eval()
            self.models[dtype] = m
        return self.models[dtype]

    # ------------------------------------------------------------------ ops
    def op_hello(self, req):
        return {
            "kvpress": getattr(kvpress, "__version__", None) or dist_version("kvpress"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "attn_implementation": self.model("float32").config._attn_implementation,
        }

    @torch.inference_mode()
    def op_kept(self, req):
        model = self.model(req.get("dtype", "float32"))
        ids = torch.tensor([req["ids"]])
        spec = req["press"]
        press = make_press(spec)
        k_len = ids.shape[1]
        n_kept = compute_n_kept(k_len, 1.0 - float(spec["cache_size"]))
        final_scores: dict[int, torch.Tensor] = {}
        base_scores: dict[int, torch.Tensor] = {}
        inner = base_press(press)
        inner.score = recording(inner.score, base_scores)
        pruned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if spec["name"] not in HEADWISE:
            if inner is not press:
                press.score = recording(press.score, final_scores)
            capture_pruning(press, pruned)
        cache = DynamicCache()
        with press(model):
            model.model(input_ids=ids, past_key_values=cache)
        if spec["name"] == "snapkv":
            final_scores = base_scores
        if spec["name"] in HEADWISE:
            kept, verified = self._masked_kept(model, cache, k_len), False
        else:
            kept, verified = self._pruned_kept(final_scores, pruned, n_kept)
        path = self.out_dir / f"kept-{time.time_ns()}.pt"
        layers = range(len(model.model.layers))
        torch.save(
            {
                "kept": kept,
                "base_scores": [base_scores[i][0] for i in layers],
                "final_scores": [final_scores[i][0] for i in layers] if final_scores else None,
            },
            path,
        )
        return {"path": str(path), "n_kept": n_kept, "k_len": k_len, "verified_against_cache": verified}

    @staticmethod
    def _masked_kept(model, cache, k_len: int) -> list[list[list[int]]]:
        """Head-wise presses mask: the kept positions are the complement of ``masked_key_indices``."""
        kept = []
        for idx, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            b_idx, h_idx, s_idx = attn.masked_key_indices
            heads = cache.layers[idx].keys.shape[1]
            mask = torch.ones(1, heads, k_len, dtype=torch.bool)
            mask[b_idx, h_idx, s_idx] = False
            kept.append([torch.nonzero(mask[0, h]).flatten().tolist() for h in range(heads)])
            attn.masked_key_indices = None
        return kept

    @staticmethod
    def _pruned_kept(final_scores: dict, pruned: dict, n_kept: int) -> tuple[list, bool]:
        """Uniform presses prune exactly as ``ScorerPress.compress``: ``scores.topk(n_kept)``; also
        whether the cache holds exactly the keys at those indices in every layer."""
        kept, verified = [], True
        for idx in range(len(pruned)):
            top = final_scores[idx].topk(n_kept, dim=-1).indices
            keys_in, keys_out = pruned[idx]
            gathered = keys_in.gather(2, top.unsqueeze(-1).expand(-1, -1, -1, keys_in.shape[-1]))
            verified = verified and torch.equal(gathered, keys_out)
            kept.append([sorted(row.tolist()) for row in top[0]])
        return kept, verified

    @torch.inference_mode()
    def op_doc(self, req):
        model = self.model(req.get("dtype", "float32"))
        ctx = torch.tensor([req["context_ids"]])
        max_new = int(req["max_new_tokens"])
        press = make_press(req.get("press"))
        hook_s = {"compress": 0.0, "norm": 0.0}
        restore = timed_press(press, hook_s) if press is not None else []
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = []  # never stop early: exactly max_new tokens
        start_rss = reset_peak()
        try:
            times, held, kept_entries, cache, answer = self._run_doc(model, press, ctx, req, max_new)
        finally:
            model.generation_config.eos_token_id = eos
            for fn in restore:
                fn()
        peak = status_bytes("VmHWM")
        t0, t1, first_end, t2 = times
        return {
            "total_s": t2 - t0,
            "prefill_s": t1 - t0,
            "compress_s": hook_s["compress"],
            "norm_s": hook_s["norm"],
            "question_s": first_end - t1 if first_end else None,
            "decode_s": (t2 - first_end) if first_end else None,
            "decode_steps": max_new - 1,
            "cache_bytes": held,
            "kv_entries_kept": kept_entries,
            "kv_entries_full": ctx.shape[1] * len(cache.layers) * cache.layers[0].keys.shape[1],
            "peak_rss_delta": max(0, peak - start_rss) if (peak is not None and start_rss is not None) else None,
            "answer": answer,
        }

    def _run_doc(self, model, press, ctx, req, max_new: int) -> tuple:
        """``KVPressTextGenerationPipeline._forward`` for one question: (times (start, prefilled,
        end of the question's forward, end), bytes held, entries kept, cache, answer)."""
        first_call_end = []

        def after_forward(module, args, kwargs, output):
            if not first_call_end:
                first_call_end.append(time.perf_counter())

        t0 = time.perf_counter()
        cache = DynamicCache()
        with press(model) if press is not None else null():
            model.model(input_ids=ctx, past_key_values=cache)
        t1 = time.perf_counter()
        held = cache_bytes(cache)
        kept_entries = self._kept_entries(model, cache, ctx.shape[1])
        handle = model.register_forward_hook(after_forward, with_kwargs=True)
        try:
            answer = self._pipeline(model).generate_answer(
                question_ids=torch.tensor([req["question_ids"]]),
                cache=cache,
                context_length=ctx.shape[1],
                max_new_tokens=max_new,
            )
        finally:
            handle.remove()
        times = (t0, t1, first_call_end[0] if first_call_end else None, time.perf_counter())
        return times, held, kept_entries, cache, answer

    @torch.inference_mode()
    def op_batch_try(self, req):
        model = self.model(req.get("dtype", "float32"))
        rows = req["rows"]
        ids = torch.tensor(rows)
        spec = req["press"]
        result = {"batch": len(rows)}
        try:
            press = make_press(spec)
            cache = DynamicCache()
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
            batched = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
            result["ran"] = True
        except Exception as exc:
            result.update(ran=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            return result
        # compare row 0's selection with row 0 alone
        heads = cache.layers[0].keys.shape[1]
        kept_batch = masked_to_kept(batched, 0, ids.shape[1], heads) if batched[0] is not None else None
        alone = self.op_kept({"ids": rows[0], "press": spec, "dtype": req.get("dtype", "float32")})
        kept_alone = torch.load(alone["path"])["kept"]
        result["row0_same_as_alone"] = kept_batch == kept_alone if kept_batch is not None else None
        if kept_batch is not None:
            pairs = [(set(a), set(b)) for la, lb in zip(kept_batch, kept_alone) for a, b in zip(la, lb)]
            result["heads"] = len(pairs)
            result["heads_identical"] = sum(a == b for a, b in pairs)
            result["heads_count_differs"] = sum(len(a) != len(b) for a, b in pairs)
            result["mean_jaccard"] = sum(len(a & b) / max(1, len(a | b)) for a, b in pairs) / max(1, len(pairs))
            result["row0_kept_entries"] = sum(len(a) for a, _ in pairs)
            result["row0_kept_entries_alone"] = sum(len(b) for _, b in pairs)
        return result

    # ------------------------------------------------------------------ helpers
    def _pipeline(self, model):
        key = id(model)
        if key not in self._pipes:
            self._pipes[key] = KVPressTextGenerationPipeline(
                model=model, tokenizer=self.tokenizer, device=torch.device("cpu")
            )
        return self._pipes[key]

    @staticmethod
    def _kept_entries(model, cache, k_len: int) -> int:
        total = 0
        for idx, layer in enumerate(model.model.layers):
            keys = cache.layers[idx].keys
            heads, length = keys.shape[1], keys.shape[2]
            masked = getattr(layer.self_attn, "masked_key_indices", None)
            total += heads * length - (len(masked[0]) if masked is not None else 0)
        return total


def main() -> None:
    p = argparse.ArgumentParser(
        description="kvpress side of benchmarks/kvpress/vs_kvpress.py (JSON lines on stdin/stdout)"
    )
    p.add_argument("--model", required=True, help="model folder (safetensors)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    side = Side(args.model)
    try:
        serve(side)
    finally:
        shutil.rmtree(side.out_dir, ignore_errors=True)


def serve(side: Side) -> None:
    send({"ok": True, "ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                send({"ok": True, "bye": True})
                break
            handler = getattr(side, f"op_{op}", None)
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            send({"ok": True, **handler(req)})
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def send(obj: dict) -> None:
    PROTOCOL_OUT.write(json.dumps(obj) + "\n")
    PROTOCOL_OUT.flush()


if __name__ == "__main__":
    main()
