"""Side by side with kvpress 0.5.5 (NVIDIA's reference implementation of CriticalKV), on SmolLM2.

kvpress needs transformers 5.2 and pandas < 3, so it runs in its own virtual environment, made by
this script on first use (``--kvpress-venv``, default ``<model cache>/kvpress-venv``: torch 2.13.0
first, then ``kvpress==0.5.5 transformers==5.2.0 "pandas<3"`` with torch held by a constraint
file; idempotent, guarded by a lock). ``benchmarks/kvpress_side.py`` runs there and answers JSON
requests over a pipe; both sides load the same safetensors folder and receive the same token ids.
Both run fp32 on the same CPU threads; runs are interleaved (ours, kvpress, kvpress, ours, ...) and
every time is a median over ``--repeats``.

Sections:

1. Faithfulness: matched settings (window 64, avg-pool kernel 5, alpha 0.5, eps 1e-4, alpha_safe
   0.2, kvpress's budget ``int(n * cache_size)`` passed to ours as an absolute budget): kept
   positions per (layer, KV head) of ours vs kvpress for snapkv / criticalkv-snapkv (uniform) and,
   as extra rows, adakv-snapkv / criticalkv-adakv-snapkv; Jaccard, identical heads, score gaps
   at the differing entries; optionally kvpress in bf16 (``--faith-dtypes``).
2. Time per document: prefill + compression + question + ``--new-tokens`` greedy tokens (EOS
   disabled on both sides so both decode exactly as many), ours (the Engine) vs kvpress
   (``KVPressTextGenerationPipeline._forward``'s calls), per method pair, ratio ours/kvpress.
3. Memory actually held by the KV cache after prefill: ours (variable-length store) vs kvpress
   (pruned tensors for uniform presses, full-size masked tensors for AdaKV presses).
4. Batch of ``--batch`` documents of different lengths (``--batch-length`` tokens for the longest, then
   10 % shorter each) with criticalkv-adakv-snapkv: ours with
   ``batch_size=B`` (left padded) and one by one vs kvpress one by one; kvpress's batched
   ``CriticalAdaKVPress`` is tried once on equal-length rows and its outcome reported.
5. Against the limit: decode ms/token vs (weights + KV entries read) / measured bandwidth, and
   CriticalKV norm time vs (norm FLOPs actually computed) / measured matmul throughput.

Usage: python benchmarks/vs_kvpress.py [--lengths 2048,4096] [--faith-lengths 2048,4096]
       [--repeats 3] [--new-tokens 32] [--cache-size 0.2] [--batch 4] [--batch-length 2048]
       [--sections 1,2,3,4,5] [--faith-dtypes float32,bfloat16] [--bf16-max-tokens 2048]
       [--out benchmarks/results/vs_kvpress.md] [--setup-only]

Development on a shared machine: ``--lengths 512 --faith-lengths 512 --repeats 1 --new-tokens 8``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from roofline import (  # noqa: E402
    RESULTS_DIR,
    PeakRSS,
    bound_norm_flops,
    decode_bound_s,
    document_of_tokens,
    exact_norm_flops,
    fmt_bytes,
    fmt_ratio,
    full_norm_flops,
    header,
    measure_limits,
    median,
    model_shape,
    norm_timer,
    parse_ints,
    table,
)

TORCH_VERSION = "2.13.0"
KVPRESS_REQUIREMENTS = ["kvpress==0.5.5", "transformers==5.2.0", "pandas<3"]
SIDE_SCRIPT = HERE / "kvpress_side.py"
METHODS_UNIFORM = ("snapkv", "criticalkv-snapkv")
METHODS_HEADWISE = ("adakv-snapkv", "criticalkv-adakv-snapkv")
KVPRESS_NAMES = {
    "none": "no press (full cache)",
    "snapkv": "SnapKVPress",
    "criticalkv-snapkv": "CriticalKVPress(SnapKVPress)",
    "adakv-snapkv": "AdaKVPress(SnapKVPress)",
    "criticalkv-adakv-snapkv": "CriticalAdaKVPress(SnapKVPress)",
}
MATCHED = dict(window=64, kernel=5, pooling="avg", first_stage_ratio=0.5, epsilon=1e-4, alpha_safeguard=0.2)


# ================================================================================ kvpress venv
def default_venv_dir() -> Path:
    from pipeline.engine.loading import default_cache_dir

    return default_cache_dir() / "kvpress-venv"


def venv_spec() -> str:
    return json.dumps({"torch": TORCH_VERSION, "requirements": KVPRESS_REQUIREMENTS, "python": sys.version_info[:2]})


def venv_stamp(venv: Path) -> Path:
    return venv / f".ckv-kvpress-{hashlib.sha256(venv_spec().encode()).hexdigest()[:12]}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_commands(venv: Path, base_python: str, constraint: Path) -> list[list[str]]:
    """The commands that build the kvpress venv (torch first, then kvpress with torch held)."""
    pip = [str(venv_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    return [
        [base_python, "-m", "venv", str(venv)],
        pip + [f"torch=={TORCH_VERSION}"],
        pip + ["-c", str(constraint), *KVPRESS_REQUIREMENTS],
        [str(venv_python(venv)), "-m", "pip", "check"],
    ]


def _base_python() -> str:
    """A Python that can make venvs: the interpreter this project's venv was built from."""
    return getattr(sys, "_base_executable", None) or sys.executable


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def ensure_kvpress_venv(venv: Path | None = None, log=None) -> dict:
    """Create the kvpress venv if it is missing or incomplete; return {python, created, seconds, size}.

    Idempotent: a stamp file naming the exact spec marks a finished install; a lock file makes
    concurrent callers wait for one install.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    venv = Path(venv or default_venv_dir()).expanduser()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if venv_stamp(venv).is_file() and venv_python(venv).exists():
            return {"python": str(venv_python(venv)), "created": False, "seconds": 0.0, "size": None}
        if venv.exists():
            log(f"kvpress venv at {venv} is incomplete; rebuilding it")
            shutil.rmtree(venv)
        log(f"creating the kvpress venv at {venv} (torch {TORCH_VERSION}, {' '.join(KVPRESS_REQUIREMENTS)})")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            constraint = Path(tmp) / "constraints.txt"
            for i, cmd in enumerate(venv_commands(venv, _base_python(), constraint)):
                if i == 2:  # hold whatever torch build step 2 installed (e.g. 2.13.0+cpu)
                    frozen = subprocess.run([str(venv_python(venv)), "-m", "pip", "freeze"], capture_output=True, text=True, check=True)
                    pins = [line for line in frozen.stdout.splitlines() if line.lower().startswith("torch==")]
                    constraint.write_text("\n".join(pins or [f"torch=={TORCH_VERSION}"]) + "\n")
                log("  $ " + " ".join(cmd))
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
                    raise RuntimeError(f"building the kvpress venv failed at: {' '.join(cmd)}\n{tail}")
        venv_stamp(venv).write_text(venv_spec() + "\n")
        seconds = time.perf_counter() - t0
        size = dir_size(venv)
        log(f"kvpress venv ready in {seconds:.0f} s, {size / 2**30:.2f} GiB")
        return {"python": str(venv_python(venv)), "created": True, "seconds": seconds, "size": size}


# ================================================================================ the kvpress process
class KvpressSide:
    """The kvpress_side.py process: one JSON request per line, one JSON reply per line."""

    def __init__(self, python: str, model_dir: str, threads: int, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [python, str(SIDE_SCRIPT), "--model", model_dir, "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"kvpress side did not start: {ready}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._log.flush()
            tail = "\n".join(Path(self.log_path).read_text().splitlines()[-30:])
            raise RuntimeError(f"kvpress side exited (code {self.proc.poll()}); log tail:\n{tail}")
        return json.loads(line)

    def request(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RuntimeError(f"kvpress side failed on {op}: {reply.get('error')} (log: {self.log_path})")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("quit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.proc.returncode == 0:  # keep the log only when something went wrong
            Path(self.log_path).unlink(missing_ok=True)

    def __enter__(self) -> KvpressSide:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ================================================================================ our side
def kvpress_n_kept(n: int, cache_size: float) -> int:
    """kvpress's ``compute_n_kept(n, 1 - cache_size)``, reproduced (float rounding included)."""
    ratio = 1.0 - cache_size
    return 0 if ratio >= 1.0 else max(1, int(n * (1 - ratio)))


def matched_config(method: str, budget: int | None = None, cache_size: float = 1.0):
    from pipeline.config import CompressionConfig

    if method == "none":
        return CompressionConfig(method="none")
    if budget is not None:
        return CompressionConfig(method=method, budget=budget, **MATCHED)
    return CompressionConfig(method=method, cache_size=cache_size, **MATCHED)


@torch.inference_mode()
@torch.inference_mode()
def capture_prefill(model, ids: torch.Tensor):
    """One prefill of ``ids`` into a capture cache (dense K/V and the window queries of every layer)."""
    from pipeline.kv.cache import VarLenCache

    capture = VarLenCache(model.config.num_hidden_layers, None, capture_window=MATCHED["window"])
    pos = torch.arange(ids.shape[1])[None]
    capture.begin_chunk(pos)
    model(input_ids=ids, position_ids=pos, cache=capture, varlen_cache=capture, use_cache=True, logits_to_keep=1)
    return capture


@torch.inference_mode()
def our_kept(model, ids: torch.Tensor, methods: list[str], budget: int, capture=None) -> dict[str, dict]:
    """Kept positions per layer and KV head of each method, from ONE capture prefill of ``ids``.

    Returns {method: {"kept": [[sorted positions] per head] per layer, "base_scores": [(H, n)] per layer}}.
    """
    import pipeline.kv.compress as compress_mod
    from pipeline.kv.cache import VarLenCache
    from pipeline.kv.compress import Compressor

    capture = capture if capture is not None else capture_prefill(model, ids)
    out = {}
    original = compress_mod.snapkv_scores
    for method in methods:
        scores: list[torch.Tensor] = []

        def capture_scores(*args, _sink=scores, **kwargs):
            s = original(*args, **kwargs)
            _sink.append(s[0].detach().clone())
            return s

        compress_mod.snapkv_scores = capture_scores
        try:
            cache = VarLenCache.from_capture(capture, Compressor(matched_config(method, budget=budget)))
        finally:
            compress_mod.snapkv_scores = original
        layers, heads = cache.num_layers, model.config.num_key_value_heads
        kept = [[cache.kept_positions(layer, 0, h).tolist() for h in range(heads)] for layer in range(layers)]
        out[method] = {"kept": kept, "base_scores": scores}
    return out


@torch.inference_mode()
def kvpress_adakv_rule(capture, layer: int, head: int, budget: int) -> tuple[set[int], int, int]:
    """kvpress ``CriticalAdaKVPress``'s effective selection for one head, recomputed with our pieces.

    kvpress sets the AdaKV safeguard's top ``n_safe = int(alpha_safe * b)`` scores to the dtype max
    before CriticalKV runs; those entries then win stage 1 and, with ``(max + eps) * norm``, stage 2
    too. So its stage 1 is effectively ``max(int(0.5 * b_h), n_safe)`` entries by base score (ours:
    ``max(floor(0.5 * b_h), window)``). The rules differ only for heads with ``b_h < 2 * n_safe``.
    Returns (kept positions, b_h, n_safe).
    """
    from pipeline.kv.budgets import adakv_head_budgets
    from pipeline.kv.criticalkv import OutputProjection, exact_l1_norms
    from pipeline.kv.scorers import snapkv_scores

    module, q_tail, key, value, key_pos, scaling = capture.captured[layer]
    dim = key.shape[3]
    scores = snapkv_scores(q_tail, key, key_pos, torch.tensor([MATCHED["window"]]), MATCHED["kernel"], MATCHED["pooling"], scaling)
    hb = int(adakv_head_budgets(scores, torch.tensor([budget]), MATCHED["alpha_safeguard"])[0, head])
    n_safe = max(1, int(budget * MATCHED["alpha_safeguard"]))
    s = scores[0, head]
    stage1 = min(hb, max(int(hb * MATCHED["first_stage_ratio"]), n_safe))
    first = torch.argsort(s, descending=True, stable=True)[:stage1]
    proj = OutputProjection.from_weight(module.o_proj.weight, key.shape[1], dim)
    crit = (s.clamp(min=0) + MATCHED["epsilon"]) * exact_l1_norms(value[0, head], proj, head)
    crit[first] = float("-inf")
    second = torch.topk(crit, hb - stage1).indices if hb > stage1 else first[:0]
    return set(first.tolist()) | set(second.tolist()), hb, n_safe


def agreement(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> dict:
    """Agreement of two kept-position sets per (layer, head): Jaccard, identical heads, differing entries."""
    jac, identical, differing, per_layer, worst = [], 0, 0, [], []
    for layer, (lo, lt) in enumerate(zip(ours, theirs)):
        row = []
        for head, (a, b) in enumerate(zip(lo, lt)):
            sa, sb = set(a), set(b)
            union = len(sa | sb)
            j = len(sa & sb) / union if union else 1.0
            jac.append(j)
            row.append(j)
            identical += sa == sb
            differing += len(sa ^ sb)
            if sa != sb:
                worst.append((j, layer, head))
        per_layer.append(row)
    worst.sort()
    return {
        "heads": len(jac),
        "identical": identical,
        "mean_jaccard": sum(jac) / len(jac) if jac else float("nan"),
        "min_jaccard": min(jac) if jac else float("nan"),
        "differing_entries": differing,
        "per_layer": per_layer,
        "worst": worst[:5],
    }


def score_gap_at_differences(ours, theirs, final_scores) -> tuple[float | None, int]:
    """(largest relative distance, stage-1 count) over entries kept by one side only.

    The distance is between kvpress's final score of such an entry and kvpress's selection
    threshold (its k-th largest final score in that head); tiny values (~1e-6) mean the sides
    disagree only on entries that tie within rounding. Entries that kvpress marked as stage-1
    picks (score = dtype max) are counted separately: they differ in the base-score ranking.
    """
    if final_scores is None:
        return None, 0
    worst, stage1 = 0.0, 0
    for layer, (lo, lt) in enumerate(zip(ours, theirs)):
        scores = final_scores[layer]
        for head, (a, b) in enumerate(zip(lo, lt)):
            diff = set(a) ^ set(b)
            if not diff:
                continue
            s = scores[head].double()
            marked = s >= 1e30
            thr = torch.topk(s, len(b)).values[-1]
            idx = torch.tensor(sorted(diff))
            stage1 += int(marked[idx].sum())
            idx = idx[~marked[idx]]
            if idx.numel() and thr < 1e30:
                worst = max(worst, float(((s[idx] - thr).abs() / thr.abs().clamp(min=1e-30)).max()))
    return worst, stage1


def base_score_difference(ours_scores, their_scores, window: int) -> float:
    """max |ours - kvpress| / max kvpress over non-window positions of the base SnapKV scores."""
    worst = 0.0
    for ours, theirs in zip(ours_scores, their_scores):
        a, b = ours[:, :-window].double(), theirs[:, :-window].double()
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)))
    return worst


def make_engine(loaded, method: str, cache_size: float, new_tokens: int, batch_size: int = 1):
    """An Engine with the matched settings that never stops at EOS (exactly ``new_tokens`` tokens)."""
    from pipeline.config import GenerationConfig
    from pipeline.engine.engine import Engine

    cfg = matched_config(method, cache_size=cache_size)
    engine = Engine(loaded, cfg, GenerationConfig(max_new_tokens=new_tokens, batch_size=batch_size))
    engine.eos_ids = set()  # benchmark: decode exactly new_tokens tokens, like the kvpress side
    return engine


def encode_for_kvpress(engine, doc: dict, new_tokens: int) -> tuple[list[int], list[int]]:
    """The exact context and question token ids the engine prefills for ``doc``."""
    prompt = engine.prompts.encode(
        doc["context"], [doc["question"]], doc["answer_prefix"],
        max_total_tokens=engine.max_context_tokens, reserve_tokens=new_tokens, truncate=engine.generation.truncate,
    )
    return list(prompt.context_ids), list(prompt.question_ids[0])


def our_docs_run(engine, docs: list[dict], new_tokens: int) -> dict:
    """Run ``docs`` through the engine (batch size as configured); wall time, times and bytes."""
    from pipeline.engine.types import Request
    from pipeline.kv.criticalkv import NormStats

    engine.compressor.norm_stats = NormStats()
    requests = [
        Request(f"bench-{i}", d["context"], [d["question"]], answer_prefix=d["answer_prefix"], max_new_tokens=new_tokens)
        for i, d in enumerate(docs)
    ]
    with norm_timer() as nt, PeakRSS() as mem:
        t0 = time.perf_counter()
        answers = engine.generate(requests)
        total = time.perf_counter() - t0
    for a in answers:
        if a.error:
            raise RuntimeError(f"engine failed: {a.error}")
    a = answers[0]
    return {
        "total_s": total,
        "ttft_s": a.ttft_s,
        "compress_s": a.compress_s,
        "decode_ms": a.decode_ms_per_token,
        "norm_s": nt["exact_s"] + nt["bound_s"],
        "norm_exact_entries": engine.compressor.norm_stats.exact,
        "kv_bytes": sum(x.kv_bytes_kept for x in answers),
        "kv_bytes_each": [x.kv_bytes_kept for x in answers],
        "kv_entries": sum(x.kv_entries_kept for x in answers),
        "kv_entries_full": sum(x.kv_entries_full for x in answers),
        "context_tokens": [x.context_tokens for x in answers],
        "question_tokens": a.question_tokens,
        "peak_rss_delta": mem.delta_bytes,
        "prediction": a.prediction,
    }


def press_spec(method: str, cache_size: float) -> dict | None:
    if method == "none":
        return None
    return {"name": method, "cache_size": cache_size, "window": MATCHED["window"], "kernel": MATCHED["kernel"],
            "epsilon": MATCHED["epsilon"], "first_stage_ratio": MATCHED["first_stage_ratio"],
            "alpha_safeguard": MATCHED["alpha_safeguard"]}


# ================================================================================ sections
class Report:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.parts.append(text)

    def write(self, path: Path | None) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(self.parts) + "\n")
        print(f"\n(written to {path})", file=sys.stderr)


def load_model_dtype(dtype: str):
    """SmolLM2 in ``dtype`` on CPU with our attention registered (for the bf16 faithfulness rows)."""
    from pipeline.config import ModelConfig
    from pipeline.engine.loading import load_model
    from pipeline.kv.attention import register

    loaded = load_model(ModelConfig(name="smollm2", device="cpu", dtype=dtype))
    loaded.model.set_attn_implementation(register())
    return loaded.model


def section_faithfulness(out: Report, loaded, side: KvpressSide, lengths, cache_size, dtypes, per_layer: bool,
                         bf16_max_tokens: int) -> None:
    from common import context_ids

    tok = loaded.tokenizer
    models = {d: (loaded.model if d == "float32" else load_model_dtype(d)) for d in dtypes}
    out("\n## 1. Faithfulness: kept positions per (layer, KV head), ours vs kvpress\n")
    out(f"Same prompt ids (built-in sample text, no chat template), matched settings: window {MATCHED['window']}, "
        f"avg-pool kernel {MATCHED['kernel']}, first-stage ratio {MATCHED['first_stage_ratio']}, epsilon {MATCHED['epsilon']}, "
        f"AdaKV safeguard {MATCHED['alpha_safeguard']}; budget = kvpress's `int(n * {cache_size})` entries per head, given to "
        f"ours as an absolute budget. Both sides load the same weights in the row's dtype (bf16 rows: as on a GPU); ours "
        f"always computes scores and norms in fp32, kvpress in the model dtype. kvpress's kept positions: "
        f"`scores.topk(n_kept)` on the captured press scores (exactly what `ScorerPress.compress` prunes with) for "
        f"uniform presses; the complement of `masked_key_indices` for AdaKV presses (which mask, not prune).\n")
    rows, detail, unverified = [], [], []
    fp32_all_identical = True
    for n in lengths:
        ids = context_ids(tok, n)
        budget = kvpress_n_kept(n, cache_size)
        if budget < MATCHED["window"]:
            out(f"(skipping {n} tokens: budget {budget} < window {MATCHED['window']})")
            continue
        ours_by_dtype = {}
        for dtype in dtypes:
            if dtype != "float32" and n > bf16_max_tokens:
                continue
            methods = METHODS_UNIFORM + METHODS_HEADWISE if dtype == "float32" else METHODS_UNIFORM
            capture = capture_prefill(models[dtype], ids)
            ours_by_dtype[dtype] = our_kept(models[dtype], ids, list(methods), budget, capture)
            for method in methods:
                reply = side.request("kept", ids=ids[0].tolist(), press=press_spec(method, cache_size), dtype=dtype)
                theirs = torch.load(reply["path"])
                if method in METHODS_UNIFORM and not reply.get("verified_against_cache"):
                    unverified.append(f"{method} {dtype} {n}")
                os.unlink(reply["path"])
                ag = agreement(ours_by_dtype[dtype][method]["kept"], theirs["kept"])
                if dtype == "float32" and ag["identical"] != ag["heads"]:
                    fp32_all_identical = False
                gap, stage1 = score_gap_at_differences(ours_by_dtype[dtype][method]["kept"], theirs["kept"], theirs["final_scores"])
                base_diff = base_score_difference(ours_by_dtype[dtype][method]["base_scores"], theirs["base_scores"], MATCHED["window"])
                rows.append([
                    method, KVPRESS_NAMES[method], dtype, n, budget,
                    f"{ag['identical']}/{ag['heads']} ({ag['identical'] / ag['heads']:.1%})",
                    f"{ag['mean_jaccard']:.5f}", f"{ag['min_jaccard']:.4f}", ag["differing_entries"],
                    "-" if gap is None or not ag["differing_entries"] else f"{gap:.1e}" + (f" ({stage1} in stage 1)" if stage1 else ""),
                    f"{base_diff:.1e}",
                ])
                if method == "criticalkv-adakv-snapkv" and ag["identical"] != ag["heads"]:
                    differing = [(layer, head) for layer, (lo, lt) in enumerate(zip(ours_by_dtype[dtype][method]["kept"], theirs["kept"]))
                                 for head, (a, b) in enumerate(zip(lo, lt)) if set(a) != set(b)]
                    checks = [(kvpress_adakv_rule(capture, layer, head, budget), theirs["kept"][layer][head]) for layer, head in differing]
                    explained = sum(rule == set(kv) for (rule, _, _), kv in checks)
                    small = sum(hb < 2 * n_safe for (_, hb, n_safe), _ in checks)
                    n_safe = checks[0][0][2]
                    detail.append(
                        f"- {method} vs {KVPRESS_NAMES[method]} ({dtype}, {n} tokens): the {len(differing)} differing heads have "
                        f"head budgets {', '.join(str(hb) for (_, hb, _), _ in checks)}; {small} of them are below 2 x the "
                        f"safeguard ({2 * n_safe}). Recomputing kvpress's effective rule (its safeguard's top {n_safe} "
                        f"entries are set to the dtype max before CriticalKV, so they fill stage 1 and survive stage 2: stage 1 "
                        f"= max(int(0.5 b_h), {n_safe}) entries by base score, where ours uses max(floor(0.5 b_h), window)) "
                        f"reproduces kvpress's selection in {explained} of {len(differing)} of them. This is a kvpress side "
                        f"effect, not the paper's rule (a head at the safeguard floor, b_h <= {n_safe}, keeps no entry by "
                        f"criticality in kvpress).")
                if ag["worst"]:
                    detail.append(f"- {method} vs {KVPRESS_NAMES[method]} ({dtype}, {n} tokens): lowest-Jaccard (layer, head): "
                                  + ", ".join(f"({layer}, {head}) {j:.3f}" for j, layer, head in ag["worst"]))
                if per_layer:
                    detail.append("  - per layer mean Jaccard: " + ", ".join(f"L{i} {sum(r) / len(r):.3f}" for i, r in enumerate(ag["per_layer"])))
    out(table(["ours", "kvpress", "model dtype (both)", "tokens", "kept / head", "(layer, head) identical", "mean Jaccard",
               "min Jaccard", "entries kept by one side only", "max rel. score gap at those entries", "base score max rel. diff"],
              rows, "lllrrrrrrrr"))
    if detail:
        out("\n" + "\n".join(detail))
    out("\nkvpress's uniform-press indices were checked against the pruned cache: the K tensors the press returned equal "
        "the input keys gathered at those indices in every layer" + (f", EXCEPT for: {', '.join(unverified)}." if unverified else "."))
    out("\nReading the table: *entries kept by one side only* counts both sides' extras over all (layer, head) pairs. "
        "*max rel. score gap* is how far from kvpress's own selection threshold (its k-th best final score in that head) "
        "those entries' kvpress scores lie: ~1e-6 means both sides disagree only on entries whose scores tie within fp32 "
        "rounding (the order of operations differs: kvpress recomputes the window queries from the hidden states and "
        "divides by sqrt(d) after the matmul; ours reuses the attention's queries); entries marked *in stage 1* are "
        "CriticalKV stage-1 picks of one side only (a base-score ranking difference). *base score max rel. diff* compares "
        "the raw SnapKV scores of both sides (non-window positions). bf16 rows: kvpress casts the fp32 softmax back to "
        "bf16 and averages, pools and computes the projected norms (`V @ W_O` and the L1 sum) in bf16, i.e. with 8 "
        "mantissa bits, so scores closer than ~0.4 % are in arbitrary order; ours scores and norms in fp32 from the "
        "same bf16 K/V. Structural differences that matched settings do not remove"
        + (" (none of them changed a selection in the fp32 rows above)" if fp32_all_identical else "")
        + ": (a) kvpress `CriticalAdaKVPress` sets the AdaKV safeguard's top `int(0.2 b)` scores to the dtype max "
        "before the two CriticalKV stages, so those entries are kept by base score whatever the stage-1 ratio: its "
        "stage 1 is effectively `max(int(0.5 b_h), int(0.2 b))` entries, ours `max(floor(0.5 b_h), window)`, as the "
        "paper describes; the two differ only in heads whose AdaKV budget b_h is below 0.4 b (checked head by head "
        "above where it happens); (b) kvpress gives the window the score max+1 instead of +inf (same effect while "
        "scores are probabilities); (c) kvpress's `CriticalAdaKVPress` stage 1 may keep fewer entries than the window "
        "(`int(0.5 b_h)` < window), ours never does; the window's max+1 scores still win kvpress's stage 2.")


def section_time(out: Report, loaded, side: KvpressSide, lengths, cache_size, repeats, new_tokens, methods, limits, shape) -> list[dict]:
    out(f"\n## 2. Time per document: prefill + compression + question + {new_tokens} tokens\n")
    out(f"cache_size {cache_size} (kept fraction), matched settings as in section 1. Ours: `Engine.generate` (batch_size 1, "
        f"chat template, EOS disabled). kvpress: the calls of `KVPressTextGenerationPipeline._forward` (press context "
        f"around `model.model(context)`, then `generate_answer`) on the SAME token ids, EOS disabled. Medians of "
        f"{repeats} interleaved runs (order alternates each repeat). Ratios < 1: ours is faster.\n")
    engines = {m: make_engine(loaded, m, cache_size, new_tokens) for m in methods}
    results = []
    for n in lengths:
        body = n - len(engines[methods[0]].prompts.encode("", ["q"]).context_ids)
        doc = document_of_tokens(loaded.tokenizer, body, seed=n)
        ctx_ids, q_ids = encode_for_kvpress(engines[methods[0]], doc, new_tokens)
        # warm-up both sides on a short prefix
        warm = document_of_tokens(loaded.tokenizer, 128, seed=1)
        our_docs_run(engines[methods[-1]], [warm], 2)
        side.request("doc", context_ids=ctx_ids[:160], question_ids=q_ids, max_new_tokens=2, press=None)
        ours = {m: [] for m in methods}
        theirs = {m: [] for m in methods}
        for r in range(repeats):
            for m in methods:
                order = ("ours", "kvpress") if r % 2 == 0 else ("kvpress", "ours")
                for who in order:
                    if who == "ours":
                        ours[m].append(our_docs_run(engines[m], [doc], new_tokens))
                    else:
                        theirs[m].append(side.request("doc", context_ids=ctx_ids, question_ids=q_ids,
                                                      max_new_tokens=new_tokens, press=press_spec(m, cache_size)))
        for m in methods:
            o, t = ours[m], theirs[m]
            t_ttft = [x["prefill_s"] + x["question_s"] for x in t]
            t_dec = [1000 * x["decode_s"] / x["decode_steps"] for x in t]
            results.append({
                "method": m, "tokens": len(ctx_ids), "question_tokens": len(q_ids),
                "ours_total": median([x["total_s"] for x in o]), "kv_total": median([x["total_s"] for x in t]),
                "paired_ratio": median([a["total_s"] / b["total_s"] for a, b in zip(o, t)]),
                "ours_ttft": median([x["ttft_s"] for x in o]), "kv_ttft": median(t_ttft),
                "ours_compress": median([x["compress_s"] for x in o]), "kv_compress": median([x["compress_s"] for x in t]),
                "ours_norm": median([x["norm_s"] for x in o]), "kv_norm": median([x["norm_s"] for x in t]),
                "ours_exact": o[0]["norm_exact_entries"],
                "ours_decode_ms": median([x["decode_ms"] for x in o]), "kv_decode_ms": median(t_dec),
                "ours_bytes": o[0]["kv_bytes"], "kv_bytes": t[0]["cache_bytes"],
                "ours_entries": o[0]["kv_entries"], "kv_entries": t[0]["kv_entries_kept"], "full_entries": t[0]["kv_entries_full"],
                "ours_rss": median([x["peak_rss_delta"] for x in o]), "kv_rss": median([x["peak_rss_delta"] for x in t]),
                "ours_answer": o[0]["prediction"], "kv_answer": t[0]["answer"],
            })
    rows = [[r["method"], KVPRESS_NAMES[r["method"]], r["tokens"], f"{r['ours_total']:.2f}", f"{r['kv_total']:.2f}",
             fmt_ratio(r["ours_total"], r["kv_total"]), f"{r['paired_ratio']:.2f}",
             "yes" if (r["ours_answer"] or "").strip() == (r["kv_answer"] or "").strip() else "no"] for r in results]
    out(table(["ours", "kvpress", "context tokens", "ours s/doc", "kvpress s/doc", "ours / kvpress",
               "median of paired ratios", f"same {new_tokens} generated tokens"], rows, "llrrrrrl"))
    out("\nBreakdown (medians):\n")
    rows = []
    for r in results:
        rows.append([
            r["method"], r["tokens"], f"{r['ours_ttft']:.2f} / {r['kv_ttft']:.2f}", fmt_ratio(r["ours_ttft"], r["kv_ttft"]),
            f"{r['ours_compress']:.3f} / {r['kv_compress']:.3f}" if r["method"] != "none" else "-",
            fmt_ratio(r["ours_compress"], r["kv_compress"]) if r["method"] != "none" else "-",
            f"{r['ours_decode_ms']:.1f} / {r['kv_decode_ms']:.1f}", fmt_ratio(r["ours_decode_ms"], r["kv_decode_ms"]),
        ])
    out(table(["method", "tokens", "TTFT s ours / kvpress", "ratio", "compression s ours / kvpress", "ratio",
               "decode ms/token ours / kvpress", "ratio"], rows, "lrrrrrrr"))
    out("\nTTFT = context prefill (with compression) + question prefill. Compression: ours = scoring + selection + "
        "copy into the variable-length store (`compress_s`); kvpress = time inside the press's forward hooks. "
        "Decode: mean ms per greedy step after the first token. *Paired ratios*: ours / kvpress of the two runs made "
        "back to back in each repeat (less sensitive to load drift than the ratio of medians). *Same generated "
        "tokens*: the decoded greedy text of both sides is identical (same model, same kept entries).")
    return results


def section_memory(out: Report, results: list[dict], cache_size: float, shape) -> None:
    out(f"\n## 3. Memory actually held by the KV cache after prefill (cache_size {cache_size})\n")
    out("Bytes of every tensor the cache holds after the context prefill: ours = `VarLenCache.nbytes`-style accounting "
        "(K, V, int32 positions, segment table); kvpress = storage of the DynamicCache's K/V tensors. Uniform presses "
        "prune in kvpress (real saving); AdaKV presses only mask evicted keys (full-size tensors). Peak RSS = process "
        "high-water mark above its level at the start of the document (activations included). *Entries kept* is "
        "logical: kvpress's masked entries still sit in memory and in every decode step's attention matmul.\n")
    rows = []
    for r in results:
        full = r["full_entries"] * shape.kv_entry_bytes_fp32
        rows.append([
            r["method"], r["tokens"], fmt_bytes(full), fmt_bytes(r["ours_bytes"]), f"{r['ours_bytes'] / full:.3f}",
            fmt_bytes(r["kv_bytes"]), f"{r['kv_bytes'] / full:.3f}", fmt_ratio(r["ours_bytes"], r["kv_bytes"], 3),
            f"{r['ours_entries'] / r['full_entries']:.3f} / {r['kv_entries'] / r['full_entries']:.3f}",
            f"{fmt_bytes(r['ours_rss'])} / {fmt_bytes(r['kv_rss'])}" if r["ours_rss"] == r["ours_rss"] and r["kv_rss"] == r["kv_rss"] else "n/a",
        ])
    out(table(["method", "tokens", "full KV (fp32)", "ours held", "ours / full", "kvpress held", "kvpress / full",
               "ours / kvpress", "entries kept ours / kvpress (fraction of full)", "peak RSS delta ours / kvpress"], rows, "lrrrrrrrrr"))


def section_batch(out: Report, loaded, side: KvpressSide, n: int, batch: int, cache_size, repeats, new_tokens, shape) -> None:
    method = "criticalkv-adakv-snapkv"
    out(f"\n## 4. Batch of {batch} documents, {method} at {cache_size}\n")
    eng_b = make_engine(loaded, method, cache_size, new_tokens, batch_size=batch)
    eng_1 = make_engine(loaded, method, cache_size, new_tokens, batch_size=1)
    head = len(eng_1.prompts.encode("", ["q"]).context_ids)
    lengths = [max(256, int(n * (1.0 - 0.1 * i))) for i in range(batch)]
    docs = [document_of_tokens(loaded.tokenizer, L - head, seed=100 + i) for i, L in enumerate(lengths)]
    encoded = [encode_for_kvpress(eng_1, d, new_tokens) for d in docs]
    walls = {"ours batched": [], "ours one by one": [], "kvpress one by one": []}
    held = {}
    for r in range(repeats):
        order = list(walls) if r % 2 == 0 else list(reversed(walls))
        for who in order:
            if who == "ours batched":
                res = our_docs_run(eng_b, docs, new_tokens)
                walls[who].append(res["total_s"])
                held[who] = res["kv_bytes"]
            elif who == "ours one by one":
                res = our_docs_run(eng_1, docs, new_tokens)
                walls[who].append(res["total_s"])
                held[who] = max(res["kv_bytes_each"])
            else:
                total, biggest = 0.0, 0
                for ctx, q in encoded:
                    rep = side.request("doc", context_ids=ctx, question_ids=q, max_new_tokens=new_tokens, press=press_spec(method, cache_size))
                    total += rep["total_s"]
                    biggest = max(biggest, rep["cache_bytes"])
                walls[who].append(total)
                held[who] = biggest
    kv = median(walls["kvpress one by one"])
    rows = [[who, ", ".join(str(len(c)) for c, _ in encoded), f"{median(v):.2f}", fmt_ratio(median(v), kv),
             f"{median([a / b for a, b in zip(v, walls['kvpress one by one'])]):.2f}",
             fmt_bytes(held[who]) if held.get(who) else "n/a"] for who, v in walls.items()]
    out(table(["setup", "context tokens", f"wall s for {batch} docs (median of {repeats})", "ratio to kvpress",
               "median of paired ratios", "KV bytes held at once (max)"], rows, "lrrrrr"))
    # kvpress batched CriticalAdaKV, once, on equal-length rows
    m = min(len(c) for c, _ in encoded)
    attempt = side.request("batch_try", rows=[c[:m] for c, _ in encoded], press=press_spec(method, cache_size))
    if not attempt.get("ran"):
        verdict = f"fails: `{attempt.get('error')}`"
    elif attempt.get("row0_same_as_alone"):
        verdict = "runs, and row 0's selection equals its one-by-one selection"
    else:
        verdict = (f"runs but selects differently from one document at a time: for row 0, "
                   f"{attempt.get('heads_identical')}/{attempt.get('heads')} (layer, head) pairs keep the same positions, "
                   f"{attempt.get('heads_count_differs')} keep a different number of entries (head budgets are computed from "
                   f"the top-k over the whole batch: `CriticalAdaKVPress` sums the per-head counts over all rows), mean "
                   f"Jaccard {attempt.get('mean_jaccard', float('nan')):.3f}")
    out(f"\nkvpress `CriticalAdaKVPress` on a batch of {batch} equal-length rows ({m} tokens, no padding, since kvpress "
        f"has no left-padding support): {verdict}. Hence kvpress is run one document at a time; its pipeline takes one "
        f"context per call anyway. Ours holds all {batch} compressed caches at once (variable-length rows, left padded); "
        f"kvpress one by one holds one full-size masked cache at a time.")


def section_limits(out: Report, results: list[dict], limits, shape, new_tokens: int) -> None:
    out("\n## 5. Against the limit (roofline-style bounds on this machine)\n")
    out(table(["limit", "measured", "how"], limits.rows(), "lrl"))
    out("\n(Limits: best of a measurement at the start and one at the end of this run.)")
    out(f"\nDecode: bound = max(bytes read / {limits.bandwidth_gbs:.1f} GB/s, FLOPs / {limits.matmul_gflops:.0f} GFLOP/s); "
        f"bytes = weights ({fmt_bytes(shape.weight_bytes)}, tied embedding once) + every KV entry the step attends to "
        f"(context entries kept, or all of them when masked, + question + half the generated tokens, fp32 K+V). "
        f"Achieved = bound / measured.\n")
    rows = []
    for r in results:
        extra = (r["question_tokens"] + new_tokens / 2) * shape.layers * shape.kv_heads
        ours_read = r["ours_entries"] + extra
        kv_read = (r["full_entries"] if r["method"] in METHODS_HEADWISE or r["method"] == "none" else r["kv_entries"]) + extra
        ob, _, _ = decode_bound_s(shape, ours_read, limits)
        kb, _, _ = decode_bound_s(shape, kv_read, limits)
        rows.append([r["method"], r["tokens"], f"{1000 * ob:.1f}", f"{r['ours_decode_ms']:.1f}", f"{1000 * ob / r['ours_decode_ms']:.0%}",
                     f"{1000 * kb:.1f}", f"{r['kv_decode_ms']:.1f}", f"{1000 * kb / r['kv_decode_ms']:.0%}"])
    out(table(["method", "tokens", "ours bound ms", "ours measured ms", "ours achieved", "kvpress bound ms",
               "kvpress measured ms", "kvpress achieved"], rows, "lrrrrrrr"))
    crit = [r for r in results if r["method"].startswith("criticalkv")]
    if crit:
        out(f"\nCriticalKV norms: bound = FLOPs / {limits.matmul_gflops:.0f} GFLOP/s. Ours computes exact L1 norms only "
            "for the stage-2 candidates that can still make the top-k (count below) plus a D x D Gram bound for every "
            "entry; kvpress computes the exact norm of every entry of every layer (a Python loop per query head). "
            "Measured: ours = time inside the norm functions; kvpress = time inside `CriticalKVPress.vwl1norm`.\n")
        rows = []
        for r in crit:
            n_entries = r["tokens"] * shape.layers * shape.kv_heads
            of = exact_norm_flops(shape, r["ours_exact"]) + bound_norm_flops(shape, n_entries)
            kf = full_norm_flops(shape, r["tokens"])
            ob, kb = of / (limits.matmul_gflops * 1e9), kf / (limits.matmul_gflops * 1e9)
            rows.append([r["method"], r["tokens"], f"{r['ours_exact']} / {n_entries}", f"{of / 1e9:.2f}", f"{1000 * ob:.1f}",
                         f"{1000 * r['ours_norm']:.1f}", f"{ob / r['ours_norm']:.0%}" if r["ours_norm"] else "n/a",
                         f"{kf / 1e9:.2f}", f"{1000 * kb:.1f}", f"{1000 * r['kv_norm']:.1f}", f"{kb / r['kv_norm']:.0%}" if r["kv_norm"] else "n/a",
                         fmt_ratio(r["ours_norm"], r["kv_norm"]),
                         f"{r['ours_norm'] / r['ours_compress']:.0%} / {r['kv_norm'] / r['kv_compress']:.0%}"
                         if r["ours_compress"] and r["kv_compress"] else "n/a"])
        out(table(["method", "tokens", "ours exact norms / entries", "ours GFLOP", "ours bound ms", "ours measured ms",
                   "ours achieved", "kvpress GFLOP", "kvpress bound ms", "kvpress measured ms", "kvpress achieved",
                   "norm time ours / kvpress", "norms' share of compression time ours / kvpress"], rows, "lrrrrrrrrrrrr"))


# ================================================================================ main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096", help="context tokens for sections 2, 3, 5")
    p.add_argument("--faith-lengths", default="2048,4096", help="context tokens for section 1")
    p.add_argument("--faith-dtypes", default="float32,bfloat16", help="model dtypes (both sides) for section 1")
    p.add_argument("--bf16-max-tokens", type=int, default=2048, help="section 1: non-fp32 rows only up to this length (slow on CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cache-size", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--batch-length", type=int, default=None, help="longest document of the batch (default: min of --lengths)")
    p.add_argument("--methods", default="none,snapkv,criticalkv-snapkv,criticalkv-adakv-snapkv")
    p.add_argument("--sections", default="1,2,3,4,5")
    p.add_argument("--per-layer", action="store_true", help="section 1: print per-layer mean Jaccard")
    p.add_argument("--kvpress-venv", default=None)
    p.add_argument("--setup-only", action="store_true", help="create the kvpress venv and exit")
    p.add_argument("--out", default=str(RESULTS_DIR / "vs_kvpress.md"), help="also write the Markdown here ('' = don't)")
    args = p.parse_args(argv)

    info = ensure_kvpress_venv(Path(args.kvpress_venv) if args.kvpress_venv else None)
    if args.setup_only:
        size = info["size"] if info["size"] is not None else dir_size(Path(info["python"]).parents[1])
        print(f"kvpress venv: {info['python']} ({'created in %.0f s' % info['seconds'] if info['created'] else 'already there'}, {size / 2**30:.2f} GiB)")
        return

    from common import load_smollm2

    from pipeline.config import ModelConfig
    from pipeline.engine.loading import resolve_model_path

    sections = set(parse_ints(args.sections))
    out = Report()
    out(header("Side by side with kvpress 0.5.5 on SmolLM2-135M-Instruct"))
    loaded = load_smollm2()
    model_dir, _ = resolve_model_path(ModelConfig(name="smollm2"))
    shape = model_shape(loaded.model)
    log_path = Path(tempfile.gettempdir()) / f"kvpress_side-{os.getpid()}.log"
    with KvpressSide(info["python"], model_dir, torch.get_num_threads(), log_path) as side:
        hello = side.request("hello")
        out(f"- kvpress side: kvpress {hello['kvpress']}, transformers {hello['transformers']}, torch {hello['torch']} "
            f"({hello['threads']} threads, attention `{hello['attn_implementation']}`), venv `{Path(info['python']).parents[1]}`")
        out(f"- both sides: fp32 weights from `{model_dir}`, same token ids")
        limits = measure_limits() if 5 in sections else None
        if 1 in sections:
            section_faithfulness(out, loaded, side, parse_ints(args.faith_lengths), args.cache_size,
                                 [d for d in args.faith_dtypes.split(",") if d], args.per_layer, args.bf16_max_tokens)
        results = []
        if sections & {2, 3, 5}:
            methods = [m for m in args.methods.split(",") if m]
            results = section_time(out, loaded, side, parse_ints(args.lengths), args.cache_size, args.repeats,
                                   args.new_tokens, methods, limits, shape)
        if 3 in sections:
            section_memory(out, results, args.cache_size, shape)
        if 4 in sections:
            section_batch(out, loaded, side, args.batch_length or min(parse_ints(args.lengths)), args.batch,
                          args.cache_size, args.repeats, args.new_tokens, shape)
        if 5 in sections and results:
            limits = measure_limits().best(limits)  # best of start and end of the run
            section_limits(out, results, limits, shape, args.new_tokens)
    out.write(Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
