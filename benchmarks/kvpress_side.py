"""The kvpress half of ``benchmarks/vs_kvpress.py`` (started by ``kvpress_common.KvpressSide``);
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

Usage (by vs_kvpress.py): <kvpress-venv>/bin/python benchmarks/kvpress_side.py --model DIR [--threads N]
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
from kvpress import (  # noqa: E402
    AdaKVPress,
    CriticalAdaKVPress,
    CriticalKVPress,
    KVPressTextGenerationPipeline,
    SnapKVPress,
)
from kvpress.utils import compute_n_kept  # noqa: E402

HEADWISE = ("adakv-snapkv", "criticalkv-adakv-snapkv")


def make_press(spec: dict | None):
    """Press from a spec.

    The spec: {"name", "cache_size", "window", "kernel", "epsilon", "first_stage_ratio", "alpha_safeguard"}.
    """
    if spec is None or spec.get("name") in (None, "none"):
        return None
    ratio = 1.0 - float(spec["cache_size"])
    base = SnapKVPress(
        compression_ratio=ratio, window_size=int(spec.get("window", 64)), kernel_size=int(spec.get("kernel", 5))
    )
    name = spec["name"]
    eps, fsr, alpha = (
        float(spec.get("epsilon", 1e-4)),
        float(spec.get("first_stage_ratio", 0.5)),
        float(spec.get("alpha_safeguard", 0.2)),
    )
    if name == "snapkv":
        return base
    if name == "criticalkv-snapkv":
        return CriticalKVPress(base, epsilon=eps, first_stage_ratio=fsr)
    if name == "adakv-snapkv":
        return AdaKVPress(base, alpha_safeguard=alpha)
    if name == "criticalkv-adakv-snapkv":
        return CriticalAdaKVPress(base, alpha_safeguard=alpha, epsilon=eps, first_stage_ratio=fsr)
    raise ValueError(f"unknown press {name!r}")


def base_press(press):
    return getattr(press, "press", press)


def recording(score_fn, into: dict):
    """``score_fn`` that also keeps a float copy of each layer's scores in ``into[layer_idx]``."""

    def wrapped(module, *args, **kwargs):
        scores = score_fn(module, *args, **kwargs)
        into[module.layer_idx] = scores.detach().float().clone()
        return scores

    return wrapped


def status_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak() -> int | None:
    start = status_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    return start


def cache_bytes(cache) -> int:
    """Bytes of the K/V tensors the DynamicCache holds (storage actually allocated)."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.untyped_storage().nbytes()
    return total


class Side:
    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        self.model_dir = model_dir
        self.models: dict[str, torch.nn.Module] = {}
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model(dtype)
        self.out_dir = Path(tempfile.mkdtemp(prefix="kvpress-side-"))

    def model(self, dtype: str):
        if dtype not in self.models:
            m = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype)).eval()
            self.models[dtype] = m
        return self.models[dtype]

    # ------------------------------------------------------------------ ops
    def op_hello(self, req):
        return {
            "kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
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
        if spec["name"] not in HEADWISE and inner is not press:
            press.score = recording(press.score, final_scores)
        pruned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if spec["name"] not in HEADWISE:
            compress = press.compress

            def capture_compress(module, hidden_states, keys, values, attentions, kwargs):
                k_out, v_out = compress(module, hidden_states, keys, values, attentions, kwargs)
                pruned[module.layer_idx] = (keys.detach().clone(), k_out.detach().clone())
                return k_out, v_out

            press.compress = capture_compress
        cache = DynamicCache()
        with press(model):
            model.model(input_ids=ids, past_key_values=cache)
        if spec["name"] == "snapkv":
            final_scores = base_scores
        layers = model.model.layers
        kept = []
        verified = spec["name"] not in HEADWISE
        for idx, layer in enumerate(layers):
            attn = layer.self_attn
            if spec["name"] in HEADWISE:
                b_idx, h_idx, s_idx = attn.masked_key_indices
                heads = cache.layers[idx].keys.shape[1]
                mask = torch.ones(ids.shape[0], heads, k_len, dtype=torch.bool)
                mask[b_idx, h_idx, s_idx] = False
                kept.append([torch.nonzero(mask[0, h]).flatten().tolist() for h in range(heads)])
                attn.masked_key_indices = None
            else:
                # exactly ScorerPress.compress: scores.topk(n_kept, dim=-1).indices
                idx_full = final_scores[idx].topk(n_kept, dim=-1).indices
                keys_in, keys_out = pruned[idx]
                gathered = keys_in.gather(2, idx_full.unsqueeze(-1).expand(-1, -1, -1, keys_in.shape[-1]))
                verified = verified and torch.equal(gathered, keys_out)  # the cache holds exactly these entries
                kept.append([sorted(row.tolist()) for row in idx_full[0]])
        path = self.out_dir / f"kept-{time.time_ns()}.pt"
        torch.save(
            {
                "kept": kept,
                "base_scores": [base_scores[i][0] for i in range(len(layers))],
                "final_scores": [final_scores[i][0] for i in range(len(layers))] if final_scores else None,
            },
            path,
        )
        return {"path": str(path), "n_kept": n_kept, "k_len": k_len, "verified_against_cache": verified}

    @torch.inference_mode()
    def op_doc(self, req):
        model = self.model(req.get("dtype", "float32"))
        pipe = self._pipeline(model)
        ctx = torch.tensor([req["context_ids"]])
        question = torch.tensor([req["question_ids"]])
        max_new = int(req["max_new_tokens"])
        press = make_press(req.get("press"))
        hook_s = {"compress": 0.0, "norm": 0.0}
        restore = []
        if press is not None:
            original_hook = press.forward_hook

            def timed_hook(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return original_hook(*args, **kwargs)
                finally:
                    hook_s["compress"] += time.perf_counter() - t

            press.forward_hook = timed_hook  # looked up by BasePress.__call__ when registering hooks
            original_norm = CriticalKVPress.vwl1norm

            def timed_norm(values, module):
                t = time.perf_counter()
                try:
                    return original_norm(values, module)
                finally:
                    hook_s["norm"] += time.perf_counter() - t

            CriticalKVPress.vwl1norm = staticmethod(timed_norm)
            restore.append(lambda: setattr(CriticalKVPress, "vwl1norm", staticmethod(original_norm)))
        first_call_end = []

        def after_forward(module, args, kwargs, output):
            if not first_call_end:
                first_call_end.append(time.perf_counter())

        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = []  # never stop early: exactly max_new tokens
        start_rss = reset_peak()
        try:
            t0 = time.perf_counter()
            # --- KVPressTextGenerationPipeline._forward, one question ---
            cache = DynamicCache()
            with press(model) if press is not None else _null():
                model.model(input_ids=ctx, past_key_values=cache)
            t1 = time.perf_counter()
            held = cache_bytes(cache)
            kept_entries = self._kept_entries(model, cache, ctx.shape[1])
            handle = model.register_forward_hook(after_forward, with_kwargs=True)
            try:
                answer = pipe.generate_answer(
                    question_ids=question, cache=cache, context_length=ctx.shape[1], max_new_tokens=max_new
                )
            finally:
                handle.remove()
            t2 = time.perf_counter()
        finally:
            model.generation_config.eos_token_id = eos
            for fn in restore:
                fn()
        peak = status_bytes("VmHWM")
        steps = max_new - 1
        return {
            "total_s": t2 - t0,
            "prefill_s": t1 - t0,
            "compress_s": hook_s["compress"],
            "norm_s": hook_s["norm"],
            "question_s": first_call_end[0] - t1 if first_call_end else None,
            "decode_s": (t2 - first_call_end[0]) if first_call_end else None,
            "decode_steps": steps,
            "cache_bytes": held,
            "kv_entries_kept": kept_entries,
            "kv_entries_full": ctx.shape[1] * len(cache.layers) * cache.layers[0].keys.shape[1],
            "peak_rss_delta": max(0, peak - start_rss) if (peak is not None and start_rss is not None) else None,
            "answer": answer,
        }

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
        kept_batch = (
            _masked_to_kept(batched, 0, ids.shape[1], cache.layers[0].keys.shape[1]) if batched[0] is not None else None
        )
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
        if not hasattr(self, "_pipes"):
            self._pipes = {}
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


def _masked_to_kept(masked_per_layer, row: int, k_len: int, heads: int):
    kept = []
    for masked in masked_per_layer:
        b_idx, h_idx, s_idx = masked
        mask = torch.ones(int(b_idx.max()) + 1 if len(b_idx) else row + 1, heads, k_len, dtype=torch.bool)
        mask[b_idx, h_idx, s_idx] = False
        kept.append([torch.nonzero(mask[row, h]).flatten().tolist() for h in range(heads)])
    return kept


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description="kvpress side of benchmarks/vs_kvpress.py (JSON lines on stdin/stdout)")
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
