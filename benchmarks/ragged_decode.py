"""A ragged cache's decode step, flat kernel against blocked, next to a uniform cache of the same size.

    python -m benchmarks.ragged_decode [--lengths 2048,4096,8192] [--steps 36] [--cache-size 0.2]
                                       [--out benchmarks/results/ragged_decode.md]

For each context length, SmolLM2 prefills the same ids twice: into a ragged cache
(``criticalkv-adakv-snapkv``, per-head budgets) and a uniform one (``snapkv``), both at
``--cache-size``. Then decode steps run interleaved, one at a time: a ragged step with the flat
kernel, a ragged step with the blocked kernel (the cache's ``KernelChoice``; both kernels compute
the same function, so they can share one cache), a uniform step; repeated ``--steps`` times. Steps
next to each other see the same machine load, which separate runs on a shared machine do not
(``decode_paths.py`` runs whole paths one after another). Printed: median ms per step of each, and
the ragged ÷ uniform ratios. The flat kernel's default limit (``FLAT_MAX_MASKED``) does not apply
here: both kernels are forced.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import context_ids, load_smollm2, prefill
from benchmarks.roofline import RESULTS_DIR, header, parse_ints, table, write_report
from pipeline.kv.attention.varlen_kernels import KernelChoice
from pipeline.kv.config import CompressionConfig
from pipeline.kv.storage.cache import VarLenCache, run_chunk

HERE = Path(__file__).resolve().parent

RAGGED, UNIFORM = "criticalkv-adakv-snapkv", "snapkv"


def prefilled(model, method: str, cache_size: float, ids: torch.Tensor, steps: int) -> VarLenCache:
    """A cache holding ``ids`` (1, n) compressed with ``method``, with room for ``2 * steps`` tokens."""
    cache = prefill(model, CompressionConfig(method=method, cache_size=cache_size), ids)[1]
    cache.reserve(2 * steps + 2)
    return cache


@torch.inference_mode()
def interleaved(model, ids: torch.Tensor, cache_size: float, steps: int) -> dict:
    """{"flat" | "blocked" | "uniform": [ms per step]} and the kernels each ragged step took."""
    n = ids.shape[1]
    ragged, uniform = (prefilled(model, m, cache_size, ids, steps) for m in (RAGGED, UNIFORM))
    times: dict[str, list[float]] = {"flat": [], "blocked": [], "uniform": []}
    next_pos = {"ragged": n, "uniform": n}
    token = torch.tensor([[42]])
    for step in range(steps):
        for name in times:
            cache_name = "uniform" if name == "uniform" else "ragged"
            ragged.kernels = KernelChoice(ragged=None if name == "uniform" else name)
            pos = torch.tensor([[next_pos[cache_name]]])
            t0 = time.perf_counter()
            run_chunk(model, ragged if cache_name == "ragged" else uniform, token, pos, logits_to_keep=1)
            if step >= 2:  # warm-up steps not timed
                times[name].append(1e3 * (time.perf_counter() - t0))
            next_pos[cache_name] += 1
    slots = sum(layer.keys.shape[0] for layer in ragged.store) / len(ragged.store)
    return {"times": times, "kernels": sorted(ragged.kernels_used), "slots": slots}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--cache-size", type=float, default=0.2)
    p.add_argument("--out", default=str(RESULTS_DIR / "ragged_decode.md"))
    args = p.parse_args()
    loaded = load_smollm2()
    rows = []
    for n in parse_ints(args.lengths):
        res = interleaved(loaded.model, context_ids(loaded.tokenizer, n), args.cache_size, args.steps)
        ms = {name: statistics.median(values) for name, values in res["times"].items()}
        rows.append(
            [
                str(n),
                f"{res['slots']:.0f}",
                f"{ms['uniform']:.1f}",
                f"{ms['blocked']:.1f}",
                f"{ms['flat']:.1f}",
                f"{ms['blocked'] / ms['uniform']:.3f}",
                f"**{ms['flat'] / ms['uniform']:.3f}**",
                ",".join(res["kernels"]),
            ]
        )
        print(f"{n} tokens done", flush=True)
    columns = ["tokens", "ragged slots per layer", "uniform ms", "blocked ms", "flat ms"]
    columns += ["blocked ÷ uniform", "flat ÷ uniform", "kernels"]
    title = f"Ragged decode step, flat vs blocked kernel, against a uniform cache (SmolLM2 fp32, {args.cache_size})"
    note = f"\n{args.steps} interleaved steps of each (first 2 not timed), medians\n"
    write_report("\n".join([header(title), note, table(columns, rows, "rrrrrrrl")]) + "\n", args.out)


if __name__ == "__main__":
    main()
