"""Decode step of today's CPU path against the previous one, side by side, with identical tokens.

    python -m benchmarks.decode_paths [--lengths 2048,8192] [--steps 24] [--repeats 3]
                                      [--cache-size 0.2] [--out benchmarks/results/decode_paths.md]

Paths (switches, both in the library):

* ``previous``: linear weights in the row order they are loaded in (``--weight-layout row``), a
  uniform cache's decode step through SDPA (``CRITICALKV_DENSE_DECODE=sdpa``) and a ragged cache's
  through the blocked kernel (``CRITICALKV_RAGGED_DECODE=blocked``);
* ``current``: the defaults, i.e. column-order weights on CPU (``weight_layout=auto``), grouped
  matmuls over a uniform cache's dense view (``dense-grouped``) and the flat kernel over a ragged
  cache of one row (``flat``).

For each context length and cache (``none`` = full, ``snapkv`` = uniform, ``criticalkv-adakv-snapkv``
= ragged, both at ``--cache-size``) every path prefills the same ids and decodes ``--steps`` greedy
tokens; runs alternate path order per repeat. Printed: median ms per decode step, the ratio
previous / current, whether the greedy tokens are identical, the ragged / uniform ratio, the
achieved fraction of the step's bandwidth bound (weights + KV entries read, ``roofline.py``) and
the prefill time ratio (the weight order changes the prefill's matmuls too).
Only ratios from the same run are claims.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import context_ids, load_smollm2
from benchmarks.roofline import (
    RESULTS_DIR,
    decode_bound_s,
    header,
    measure_limits,
    model_shape,
    parse_ints,
    table,
    write_report,
)
from pipeline.engine.loading import apply_weight_layout
from pipeline.kv.attention.varlen_kernels import DENSE_ENV, RAGGED_ENV
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.rope import model_rotary
from pipeline.kv.storage.cache import VarLenCache, run_chunk

HERE = Path(__file__).resolve().parent

# weight layout, dense decode kernel, ragged decode kernel ("" = the library's choice)
PATHS = {"previous": ("row", "sdpa", "blocked"), "current": ("auto", "", "")}
RAGGED = "criticalkv-adakv-snapkv"
CACHES = ("none", "snapkv", RAGGED)


def use_path(model, name: str) -> None:
    """Switch the weights' order and the dense and ragged decode kernels."""
    layout, dense, ragged = PATHS[name]
    apply_weight_layout(model, layout)
    os.environ[DENSE_ENV], os.environ[RAGGED_ENV] = dense, ragged


@torch.inference_mode()
def greedy_run(model, method: str, cache_size: float, ids: torch.Tensor, steps: int) -> dict:
    """Prefill ``ids`` (1, n) with ``method`` and decode ``steps`` greedy tokens, each step timed."""
    size = 1.0 if method == "none" else cache_size
    cache = VarLenCache(
        model.config.num_hidden_layers,
        Compressor(CompressionConfig(method=method, cache_size=size), rotary=model_rotary(model)),
    )
    n = ids.shape[1]
    t0 = time.perf_counter()
    logits = run_chunk(model, cache, ids, torch.arange(n)[None], logits_to_keep=1).logits[:, -1]
    prefill_s = time.perf_counter() - t0
    cache.reserve(steps + 1)
    tokens, seconds = [], []
    for i in range(steps):
        token = int(logits.argmax(-1))
        tokens.append(token)
        t0 = time.perf_counter()
        logits = run_chunk(model, cache, torch.tensor([[token]]), torch.tensor([[n + i]]), logits_to_keep=1).logits[
            :, -1
        ]
        seconds.append(time.perf_counter() - t0)
    entries = int(cache.entries_per_row().sum())
    return {
        "ms": 1e3 * statistics.median(seconds[2:]),
        "prefill_s": prefill_s,
        "tokens": tokens,
        "entries": entries,
        "kernels": sorted(cache.kernels_used),
    }


def measure(model, ids, cache_size: float, steps: int, repeats: int) -> dict:
    """{(method, path): {"ms": [...], "prefill_s": [...], "tokens", "entries", "kernels"}} for one context."""
    out: dict = {}
    for r in range(repeats):
        for name in PATHS if r % 2 == 0 else reversed(PATHS):
            use_path(model, name)
            for method in CACHES:
                res = greedy_run(model, method, cache_size, ids, steps)
                slot = out.setdefault((method, name), {**res, "ms": [], "prefill_s": []})
                slot["ms"].append(res["ms"])
                slot["prefill_s"].append(res["prefill_s"])
                slot["same_each_run"] = slot.get("same_each_run", True) and res["tokens"] == slot["tokens"]
    use_path(model, "current")
    return out


HEADS = [
    "tokens",
    "cache",
    "previous ms/token",
    "current ms/token",
    "speed-up",
    "same tokens",
    "÷ uniform",
    "bound achieved",
    "prefill previous ÷ current",
    "kernel",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-size", type=float, default=0.2)
    p.add_argument("--out", default=str(RESULTS_DIR / "decode_paths.md"))
    args = p.parse_args()
    loaded = load_smollm2()
    model = loaded.model
    shape, limits = model_shape(model), measure_limits()
    lines = [header("Decode step: previous CPU path vs current (SmolLM2 fp32)")]
    lines.append(
        f"\nBound = max(bytes / {limits.bandwidth_gbs:.1f} GB/s, FLOPs / {limits.matmul_gflops:.0f} GFLOP/s)\n"
    )
    rows = []
    print(f"{torch.get_num_threads()} threads", flush=True)
    for n in parse_ints(args.lengths):
        res = measure(model, context_ids(loaded.tokenizer, n), args.cache_size, args.steps, args.repeats)
        rows += [row(n, method, res, shape, limits) for method in CACHES]
        print(f"{n} tokens done", flush=True)
    lines.append(f"\n{args.steps} greedy steps per run (first 2 not timed), median of {args.repeats} runs per path\n")
    lines.append(table(HEADS, rows, "llrrrlrlrl"))
    write_report("\n".join(lines) + "\n", args.out)


def row(n: int, method: str, res: dict, shape, limits) -> list[str]:
    """One cache's previous vs current path at ``n`` tokens."""
    uniform = statistics.median(res[("snapkv", "current")]["ms"])
    prev, cur = res[(method, "previous")], res[(method, "current")]
    prev_ms, cur_ms = statistics.median(prev["ms"]), statistics.median(cur["ms"])
    bound = decode_bound_s(shape, cur["entries"], limits)[0] * 1e3
    same = prev["tokens"] == cur["tokens"] and prev["same_each_run"] and cur["same_each_run"]
    return [
        str(n),
        method,
        f"{prev_ms:.1f}",
        f"{cur_ms:.1f}",
        f"**{prev_ms / cur_ms:.2f}**",
        "yes" if same else "NO",
        f"{cur_ms / uniform:.2f}" if method != "none" else "-",
        f"{bound / prev_ms:.0%} → {bound / cur_ms:.0%}",
        f"{statistics.median(prev['prefill_s']) / statistics.median(cur['prefill_s']):.2f}",
        ",".join(prev["kernels"]) + " → " + ",".join(cur["kernels"]),
    ]


if __name__ == "__main__":
    main()
