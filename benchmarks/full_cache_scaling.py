"""Against a plain full cache: how decode cost and KV memory grow with the context, on SmolLM2.

For each context length, the same prompt ids are prefilled into the library's variable-length
cache twice: ``none`` (full cache, nothing evicted) and ``criticalkv-adakv-snapkv`` at
``--cache-size`` (library defaults otherwise). Printed, as medians of ``--repeats`` interleaved
runs:

* KV bytes held after prefill (every tensor of the cache) and their ratio to a full fp32 cache;
* prefill time (context prefill + compression) and peak resident memory above the start;
* decode ms/token (median step of ``--decode-steps`` greedy-shaped steps per run), the ratio
  compressed / full, and the roofline bound of a decode step (weights + the KV entries attended,
  over the measured memory bandwidth; see ``roofline.py``) with the achieved fraction;
* growth of each figure relative to the shortest context.

A PNG (decode ms/token and KV MiB vs context, with bounds) goes to ``--plot``.

Usage: python -m benchmarks.full_cache_scaling [--lengths 1024,2048,4096,8192] [--repeats 3]
       [--prefill-repeats 1] [--decode-steps 16] [--cache-size 0.2]
       [--out benchmarks/results/full_cache_scaling.md] [--plot benchmarks/results/full_cache_scaling.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.roofline import (
    RESULTS_DIR,
    PeakRSS,
    decode_bound_s,
    fmt_bytes,
    fmt_ratio,
    header,
    measure_limits,
    median,
    model_shape,
    parse_ints,
    table,
)

HERE = Path(__file__).resolve().parent

COMPRESSED = "criticalkv-adakv-snapkv"


def configs(cache_size: float) -> dict:
    from pipeline.kv.config import CompressionConfig

    return {
        "none": CompressionConfig(method="none"),
        COMPRESSED: CompressionConfig(method=COMPRESSED, cache_size=cache_size),
    }


def measure_length(model, ids: torch.Tensor, cfgs: dict, repeats: int, prefill_repeats: int, decode_steps: int) -> dict:
    """Prefill each config (``prefill_repeats`` interleaved runs; the last cache is kept), then time
    decode (``repeats`` interleaved runs, each rolled back to the prefilled context).

    Returns {name: {"prefill_s": [...], "peak_rss": [...], "decode_ms": [...], "kv_bytes", "kv_entries"}}.
    """
    from benchmarks.common import decode_ms_per_token, prefill

    n = ids.shape[1]
    out = {name: {"prefill_s": [], "compress_s": [], "peak_rss": [], "decode_ms": []} for name in cfgs}
    caches = {}
    for r in range(max(1, prefill_repeats)):
        names = list(cfgs) if r % 2 == 0 else list(reversed(cfgs))
        for name in names:
            caches.pop(name, None)
            with PeakRSS() as mem:
                seconds, cache = prefill(model, cfgs[name], ids)
            out[name]["prefill_s"].append(seconds)
            out[name]["compress_s"].append(cache.compress_seconds)
            out[name]["peak_rss"].append(mem.delta_bytes)
            caches[name] = cache
    for name, cache in caches.items():
        out[name]["kv_bytes"] = cache.nbytes()
        out[name]["kv_entries"] = int(cache.context_entries.sum())
    for r in range(repeats):
        names = list(cfgs) if r % 2 == 0 else list(reversed(cfgs))
        for name in names:
            cache = caches[name]
            cache.snapshot()
            out[name]["decode_ms"].append(decode_ms_per_token(model, cache, n, decode_steps))
            cache.restore()
    return out


def plot(path: Path, lengths: list[int], data: dict, bounds: dict, kv: dict) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style, color in (("none", "o-", "tab:blue"), (COMPRESSED, "s-", "tab:orange")):
        ax1.plot(lengths, data[name], style, color=color, label=f"{name} measured")
        ax1.plot(lengths, bounds[name], style[0] + "--", color=color, alpha=0.6, label=f"{name} roofline bound")
        ax2.plot(lengths, [b / 2**20 for b in kv[name]], style, color=color, label=name)
    ax1.set_xlabel("context tokens")
    ax1.set_ylabel("decode ms / token (median)")
    ax1.set_xscale("log", base=2)
    ax1.legend(fontsize=7)
    ax1.set_title("decode cost vs context")
    ax2.set_xlabel("context tokens")
    ax2.set_ylabel("KV MiB held")
    ax2.set_xscale("log", base=2)
    ax2.legend(fontsize=7)
    ax2.set_title("KV memory vs context")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--repeats", type=int, default=3, help="interleaved decode runs per length")
    p.add_argument("--prefill-repeats", type=int, default=None, help="interleaved prefill runs (default: --repeats)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--cache-size", type=float, default=0.2)
    p.add_argument(
        "--out", default=str(RESULTS_DIR / "full_cache_scaling.md"), help="also write the Markdown here ('' = don't)"
    )
    p.add_argument("--plot", default=str(RESULTS_DIR / "full_cache_scaling.png"), help="PNG path ('' = none)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from benchmarks.common import context_ids, load_smollm2

    lines: list[str] = []

    def emit(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    emit(header(f"Full cache vs {COMPRESSED} at {args.cache_size}: cost as the context grows (SmolLM2-135M)"))
    loaded = load_smollm2()
    model, tok = loaded.model, loaded.tokenizer
    shape = model_shape(model)
    limits = measure_limits()
    lengths = parse_ints(args.lengths)
    cfgs = configs(args.cache_size)
    prefill_repeats = args.prefill_repeats if args.prefill_repeats is not None else args.repeats
    warm_up(model, cfgs, tok)
    results = {}
    for n in lengths:
        results[n] = measure_length(model, context_ids(tok, n), cfgs, args.repeats, prefill_repeats, args.decode_steps)
    limits = measure_limits().best(limits)  # best of start and end of the run
    emit(
        f"\nLibrary defaults for {COMPRESSED} (window 32, max-pool 7, alpha 0.5, eps 1e-4, safeguard 0.2), fp32, "
        f"{args.decode_steps} decode steps per run; decode medians over {args.repeats} interleaved runs, prefill over "
        f"{prefill_repeats}. Bound: see section 'limits' below.\n"
    )
    rows, series = results_rows(results, lengths, list(cfgs), shape, limits, args.decode_steps)
    heads = ["tokens", "cache", "KV held", "KV / full fp32", "prefill s", "compress s", "peak RSS delta"]
    emit(table(heads + ["decode ms/token", "decode / full", "bound ms", "achieved"], rows, "rlrrrrrrrrr"))
    emit_growth(emit, lengths, list(cfgs), series, shape, limits)
    if args.plot:
        path = plot(Path(args.plot), lengths, *series)
        if path:
            emit(f"\n![decode and KV vs context]({path.name})")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        print(f"\n(written to {out})", file=sys.stderr)


def results_rows(results: dict, lengths, names, shape, limits, decode_steps: int) -> tuple[list, tuple]:
    """The main table's rows, and per config the series (decode ms, bound ms, KV bytes) over lengths."""
    rows = []
    dec, bnd, kvb = {k: [] for k in names}, {k: [] for k in names}, {k: [] for k in names}
    for n in lengths:
        full_bytes = n * shape.layers * shape.kv_heads * shape.kv_entry_bytes_fp32
        full_ms = median(results[n]["none"]["decode_ms"])
        for name in names:
            r = results[n][name]
            ms = median(r["decode_ms"])
            entries = r["kv_entries"] + shape.layers * shape.kv_heads * decode_steps / 2
            bound, _, _ = decode_bound_s(shape, entries, limits)
            dec[name].append(ms)
            bnd[name].append(1000 * bound)
            kvb[name].append(r["kv_bytes"])
            rss = median(r["peak_rss"])
            rows.append(
                [
                    n,
                    name,
                    fmt_bytes(r["kv_bytes"]),
                    f"{r['kv_bytes'] / full_bytes:.3f}",
                    f"{median(r['prefill_s']):.2f}",
                    f"{median(r['compress_s']):.3f}" if name != "none" else "-",
                    fmt_bytes(rss) if rss == rss else "n/a",
                    f"{ms:.1f}",
                    fmt_ratio(ms, full_ms),
                    f"{1000 * bound:.1f}",
                    f"{1000 * bound / ms:.0%}",
                ]
            )
    return rows, (dec, bnd, kvb)


def emit_growth(emit, lengths, names, series, shape, limits) -> None:
    """Growth relative to the shortest length, the limits table, and the bound's definition."""
    dec, bnd, kvb = series
    emit(f"\nGrowth relative to {lengths[0]} tokens (x):\n")
    rows = []
    for i, n in enumerate(lengths):
        row = [n, f"{n / lengths[0]:.0f}"]
        for name in names:
            row += [fmt_ratio(dec[name][i], dec[name][0]), fmt_ratio(kvb[name][i], kvb[name][0])]
        rows.append(row)
    heads = ["tokens", "context x", "full: decode x", "full: KV x", f"{COMPRESSED}: decode x", f"{COMPRESSED}: KV x"]
    emit(table(heads, rows, "rrrrrr"))
    emit("\n### limits\n")
    emit(table(["limit", "measured", "how"], limits.rows(), "lrl"))
    emit("\n(Limits: best of a measurement at the start and one at the end of this run.)")
    growth = [
        f"{name}: bound x{bnd[name][-1] / bnd[name][0]:.2f}, measured x{dec[name][-1] / dec[name][0]:.2f}"
        for name in names
    ]
    emit(
        f"\nDecode bound = max(bytes / {limits.bandwidth_gbs:.1f} GB/s, FLOPs / {limits.matmul_gflops:.0f} GFLOP/s), "
        f"bytes = weights ({fmt_bytes(shape.weight_bytes)}, tied embedding once) + KV entries attended "
        f"(kept context + half the decoded steps) x {shape.kv_entry_bytes_fp32} B. "
        f"From {lengths[0]} to {lengths[-1]} tokens: " + "; ".join(growth) + "."
    )


def warm_up(model, cfgs: dict, tok) -> None:
    """One short prefill + decode per config (first-call overheads out of the timings)."""
    from benchmarks.common import context_ids, decode_ms_per_token, prefill

    ids = context_ids(tok, 256)
    for cfg in cfgs.values():
        _, cache = prefill(model, cfg, ids)
        decode_ms_per_token(model, cache, 256, 2)


if __name__ == "__main__":
    main()
