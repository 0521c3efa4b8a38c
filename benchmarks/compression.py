"""Compression-core benchmarks on SmolLM2 (issue: CriticalKV compression core).

Prints, measured side by side in one run with interleaved repeats (medians):
1. prefill time (context prefill + compression) of none / snapkv / criticalkv-snapkv (exact L1)
   / criticalkv-snapkv (l2) at 2K and 4K tokens, and the ratio CriticalKV / SnapKV;
2. kept KV bytes / full KV bytes for criticalkv-snapkv and criticalkv-adakv-snapkv at 0.2 / 0.4;
3. decode ms/token at 4K, compressed (0.2) vs full cache.

Usage: python -m benchmarks.compression [--lengths 2048,4096] [--repeats 3] [--decode-steps 24]
"""

from __future__ import annotations

import argparse

from benchmarks.common import context_ids, decode_ms_per_token, load_smollm2, machine, median, prefill
from pipeline.kv.config import CompressionConfig

PREFILL_METHODS = {
    "none": CompressionConfig(method="none"),
    "snapkv": CompressionConfig(method="snapkv", cache_size=0.2),
    "criticalkv-snapkv": CompressionConfig(method="criticalkv-snapkv", cache_size=0.2),
    "criticalkv-snapkv (l2)": CompressionConfig(method="criticalkv-snapkv", cache_size=0.2, norm="l2"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=24)
    args = p.parse_args()
    loaded = load_smollm2()
    model, tok = loaded.model, loaded.tokenizer
    print(f"machine: {machine()}")
    lengths = [int(x) for x in args.lengths.split(",")]
    prefill_times(model, tok, lengths, args.repeats)
    n = max(lengths)
    ids = context_ids(tok, n)
    kept_bytes(model, ids)
    decode_times(model, ids, args.repeats, args.decode_steps)


def prefill_times(model, tok, lengths: list[int], repeats: int) -> None:
    """Context prefill + compression per method, interleaved, medians."""
    print("\n## Prefill time (context prefill + compression), median of", repeats, "interleaved runs\n")
    print(
        "| tokens | none s | snapkv s | criticalkv-snapkv s | criticalkv (l2) s | CriticalKV/SnapKV | "
        "CriticalKV-l2/SnapKV | compress share (criticalkv) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        ids = context_ids(tok, n)
        prefill(model, PREFILL_METHODS["snapkv"], ids[:, :256])  # warm-up
        times = {name: [] for name in PREFILL_METHODS}
        compress = []
        for _ in range(repeats):
            for name, cfg in PREFILL_METHODS.items():
                seconds, cache = prefill(model, cfg, ids)
                times[name].append(seconds)
                if name == "criticalkv-snapkv":
                    compress.append(cache.compress_seconds / seconds)
        m = {k: median(v) for k, v in times.items()}
        print(
            f"| {n} | {m['none']:.2f} | {m['snapkv']:.2f} | {m['criticalkv-snapkv']:.2f} | "
            f"{m['criticalkv-snapkv (l2)']:.2f} | "
            f"{m['criticalkv-snapkv'] / m['snapkv']:.3f} | {m['criticalkv-snapkv (l2)'] / m['snapkv']:.3f} | "
            f"{median(compress):.1%} |"
        )


def kept_bytes(model, ids) -> None:
    """Kept entries and bytes over the full cache's, for the CriticalKV methods at 0.2 and 0.4."""
    n = ids.shape[1]
    print(f"\n## Kept KV bytes / full KV bytes ({n} tokens; full = n x layers x kv_heads x 2 x head_dim x 4 B)\n")
    print("| method | cache_size | kept entries / full | kept bytes / full (incl. positions + segment table) |")
    print("|---|---:|---:|---:|")
    cfg = model.config
    full_entries = n * cfg.num_hidden_layers * cfg.num_key_value_heads
    full_bytes = full_entries * 2 * (cfg.hidden_size // cfg.num_attention_heads) * 4
    for method in ["criticalkv-snapkv", "criticalkv-adakv-snapkv"]:
        for size in (0.2, 0.4):
            _, cache = prefill(model, CompressionConfig(method=method, cache_size=size), ids)
            print(
                f"| {method} | {size} | {int(cache.context_entries.sum()) / full_entries:.4f} | "
                f"{cache.nbytes() / full_bytes:.4f} |"
            )


def decode_times(model, ids, repeats: int, steps: int) -> None:
    """Decode ms/token of the full cache and a 0.2 ragged cache, interleaved."""
    n = ids.shape[1]
    print(f"\n## Decode ms/token at {n} tokens (median over {steps} steps, {repeats} interleaved runs)\n")
    print("| cache | ms/token | ratio to full |")
    print("|---|---:|---:|")
    cfgs = {
        "full (none)": CompressionConfig(),
        "criticalkv-adakv-snapkv 0.2": CompressionConfig(method="criticalkv-adakv-snapkv", cache_size=0.2),
    }
    runs = {name: [] for name in cfgs}
    caches = {name: prefill(model, c, ids)[1] for name, c in cfgs.items()}
    for _ in range(repeats):
        for name in runs:
            caches[name].snapshot()
            runs[name].append(decode_ms_per_token(model, caches[name], n, steps))
            caches[name].restore()
    full = median(runs["full (none)"])
    for name, values in runs.items():
        print(f"| {name} | {median(values):.1f} | {median(values) / full:.3f} |")


if __name__ == "__main__":
    main()
