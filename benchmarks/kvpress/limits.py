"""Sections 4 and 5 of ``benchmarks/kvpress/vs_kvpress.py``: a batch of documents of different lengths, and
the measured times against roofline-style bounds on this machine."""

from __future__ import annotations

from benchmarks.kvpress.common import METHODS_HEADWISE, KvpressSide, Report, press_spec
from benchmarks.kvpress.ours import encode_for_kvpress, make_engine, our_docs_run
from benchmarks.roofline import (
    bound_norm_flops,
    decode_bound_s,
    document_of_tokens,
    exact_norm_flops,
    fmt_bytes,
    fmt_ratio,
    full_norm_flops,
    median,
    table,
)

BATCH_METHOD = "criticalkv-adakv-snapkv"
NORMS_INTRO = (
    "\nCriticalKV norms: bound = FLOPs / {gflops:.0f} GFLOP/s. "
    "Ours computes exact L1 norms only for the stage-2 candidates that can still make the top-k "
    "(count below) plus a D x D Gram bound for every "
    "entry; kvpress computes the exact norm of every entry of every layer (a Python loop per query head). "
    "Measured: ours = time inside the norm functions; kvpress = time inside `CriticalKVPress.vwl1norm`.\n"
)


def section_batch(out: Report, loaded, side: KvpressSide, n: int, batch: int, cache_size, repeats, new_tokens) -> None:
    """Section 4: ours batched (left padded) and one by one vs kvpress one by one."""
    out(f"\n## 4. Batch of {batch} documents, {BATCH_METHOD} at {cache_size}\n")
    eng_b = make_engine(loaded, BATCH_METHOD, cache_size, new_tokens, batch_size=batch)
    eng_1 = make_engine(loaded, BATCH_METHOD, cache_size, new_tokens, batch_size=1)
    head = len(eng_1.prompts.encode("", ["q"]).context_ids)
    lengths = [max(256, int(n * (1.0 - 0.1 * i))) for i in range(batch)]
    docs = [document_of_tokens(loaded.tokenizer, length - head, seed=100 + i) for i, length in enumerate(lengths)]
    encoded = [encode_for_kvpress(eng_1, d, new_tokens) for d in docs]
    walls = {"ours batched": [], "ours one by one": [], "kvpress one by one": []}
    held = {}
    for r in range(repeats):
        for who in list(walls) if r % 2 == 0 else list(reversed(walls)):
            if who == "kvpress one by one":
                seconds, held[who] = _kvpress_one_by_one(side, encoded, cache_size, new_tokens)
            else:
                res = our_docs_run(eng_b if who == "ours batched" else eng_1, docs, new_tokens)
                seconds = res["total_s"]
                held[who] = res["kv_bytes"] if who == "ours batched" else max(res["kv_bytes_each"])
            walls[who].append(seconds)
    kv = walls["kvpress one by one"]
    rows = [
        [
            who,
            ", ".join(str(len(c)) for c, _ in encoded),
            f"{median(v):.2f}",
            fmt_ratio(median(v), median(kv)),
            f"{median([a / b for a, b in zip(v, kv)]):.2f}",
            fmt_bytes(held[who]) if held.get(who) else "n/a",
        ]
        for who, v in walls.items()
    ]
    heads = ["setup", "context tokens", f"wall s for {batch} docs (median of {repeats})", "ratio to kvpress"]
    out(table(heads + ["median of paired ratios", "KV bytes held at once (max)"], rows, "lrrrrr"))
    _kvpress_batch_attempt(out, side, encoded, batch, cache_size)


def _kvpress_one_by_one(side: KvpressSide, encoded, cache_size, new_tokens) -> tuple[float, int]:
    """kvpress over the documents one at a time: (total seconds, largest cache held)."""
    total, biggest = 0.0, 0
    press = press_spec(BATCH_METHOD, cache_size)
    for ctx, q in encoded:
        rep = side.request("doc", context_ids=ctx, question_ids=q, max_new_tokens=new_tokens, press=press)
        total += rep["total_s"]
        biggest = max(biggest, rep["cache_bytes"])
    return total, biggest


def _kvpress_batch_attempt(out: Report, side: KvpressSide, encoded, batch: int, cache_size) -> None:
    """kvpress's batched CriticalAdaKV, once, on equal-length rows, and what it does."""
    m = min(len(c) for c, _ in encoded)
    attempt = side.request("batch_try", rows=[c[:m] for c, _ in encoded], press=press_spec(BATCH_METHOD, cache_size))
    if not attempt.get("ran"):
        verdict = f"fails: `{attempt.get('error')}`"
    elif attempt.get("row0_same_as_alone"):
        verdict = "runs, and row 0's selection equals its one-by-one selection"
    else:
        verdict = (
            f"runs but selects differently from one document at a time: for row 0, "
            f"{attempt.get('heads_identical')}/{attempt.get('heads')} (layer, head) pairs keep the same positions, "
            f"{attempt.get('heads_count_differs')} keep a different number of entries (head budgets are computed from "
            f"the top-k over the whole batch: `CriticalAdaKVPress` sums the per-head counts over all rows), mean "
            f"Jaccard {attempt.get('mean_jaccard', float('nan')):.3f}"
        )
    out(
        f"\nkvpress `CriticalAdaKVPress` on a batch of {batch} equal-length rows "
        f"({m} tokens, no padding, since kvpress has no left-padding support): {verdict}. "
        f"Hence kvpress is run one document at a time; its pipeline takes one context per call anyway. "
        f"Ours holds all {batch} compressed caches at once (variable-length rows, left padded); "
        f"kvpress one by one holds one full-size masked cache at a time."
    )


def section_limits(out: Report, results: list[dict], limits, shape, new_tokens: int) -> None:
    """Section 5: decode steps and CriticalKV norms against bandwidth and matmul bounds."""
    out("\n## 5. Against the limit (roofline-style bounds on this machine)\n")
    out(table(["limit", "measured", "how"], limits.rows(), "lrl"))
    out("\n(Limits: best of a measurement at the start and one at the end of this run.)")
    out(
        f"\nDecode: bound = max(bytes read / {limits.bandwidth_gbs:.1f} GB/s, "
        f"FLOPs / {limits.matmul_gflops:.0f} GFLOP/s); "
        f"bytes = weights ({fmt_bytes(shape.weight_bytes)}, tied embedding once) + every KV entry the step attends to "
        f"(context entries kept, or all of them when masked, + question + half the generated tokens, fp32 K+V). "
        f"Achieved = bound / measured.\n"
    )
    rows = [_decode_bound_row(r, limits, shape, new_tokens) for r in results]
    heads = ["method", "tokens", "ours bound ms", "ours measured ms", "ours achieved", "kvpress bound ms"]
    out(table(heads + ["kvpress measured ms", "kvpress achieved"], rows, "lrrrrrrr"))
    crit = [r for r in results if r["method"].startswith("criticalkv")]
    if crit:
        out(NORMS_INTRO.format(gflops=limits.matmul_gflops))
        heads = ["method", "tokens", "ours exact norms / entries", "ours GFLOP", "ours bound ms", "ours measured ms"]
        heads += ["ours achieved", "kvpress GFLOP", "kvpress bound ms", "kvpress measured ms", "kvpress achieved"]
        heads += ["norm time ours / kvpress", "norms' share of compression time ours / kvpress"]
        out(table(heads, [_norm_bound_row(r, limits, shape) for r in crit], "lrrrrrrrrrrrr"))


def _decode_bound_row(r: dict, limits, shape, new_tokens: int) -> list:
    """One method's decode step, ours and kvpress's, against the bound of the entries each reads."""
    extra = (r["question_tokens"] + new_tokens / 2) * shape.layers * shape.kv_heads
    ours_read = r["ours_entries"] + extra
    masked = r["method"] in METHODS_HEADWISE or r["method"] == "none"  # kvpress reads every entry
    kv_read = (r["full_entries"] if masked else r["kv_entries"]) + extra
    ob, _, _ = decode_bound_s(shape, ours_read, limits)
    kb, _, _ = decode_bound_s(shape, kv_read, limits)
    return [
        r["method"],
        r["tokens"],
        f"{1000 * ob:.1f}",
        f"{r['ours_decode_ms']:.1f}",
        f"{1000 * ob / r['ours_decode_ms']:.0%}",
        f"{1000 * kb:.1f}",
        f"{r['kv_decode_ms']:.1f}",
        f"{1000 * kb / r['kv_decode_ms']:.0%}",
    ]


def _norm_bound_row(r: dict, limits, shape) -> list:
    """One CriticalKV method's norm time, ours and kvpress's, against its FLOP bound."""
    n_entries = r["tokens"] * shape.layers * shape.kv_heads
    of = exact_norm_flops(shape, r["ours_exact"]) + bound_norm_flops(shape, n_entries)
    kf = full_norm_flops(shape, r["tokens"])
    ob, kb = of / (limits.matmul_gflops * 1e9), kf / (limits.matmul_gflops * 1e9)
    share = r["ours_compress"] and r["kv_compress"]
    return [
        r["method"],
        r["tokens"],
        f"{r['ours_exact']} / {n_entries}",
        f"{of / 1e9:.2f}",
        f"{1000 * ob:.1f}",
        f"{1000 * r['ours_norm']:.1f}",
        f"{ob / r['ours_norm']:.0%}" if r["ours_norm"] else "n/a",
        f"{kf / 1e9:.2f}",
        f"{1000 * kb:.1f}",
        f"{1000 * r['kv_norm']:.1f}",
        f"{kb / r['kv_norm']:.0%}" if r["kv_norm"] else "n/a",
        fmt_ratio(r["ours_norm"], r["kv_norm"]),
        f"{r['ours_norm'] / r['ours_compress']:.0%} / {r['kv_norm'] / r['kv_compress']:.0%}" if share else "n/a",
    ]
