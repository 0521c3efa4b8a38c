"""Sections 2 and 3 of ``benchmarks/kvpress/vs_kvpress.py``: time per document (ours vs kvpress, interleaved)
and the memory the KV cache holds after the prefill."""

from __future__ import annotations

from benchmarks.kvpress.common import KVPRESS_NAMES, KvpressSide, Report, press_spec
from benchmarks.kvpress.ours import encode_for_kvpress, make_engine, our_docs_run
from benchmarks.roofline import document_of_tokens, fmt_bytes, fmt_ratio, median, table

TIME_INTRO = (
    "cache_size {cache_size} (kept fraction), matched settings as in section 1. "
    "Ours: `Engine.generate` (batch_size 1, chat template, EOS disabled). "
    "kvpress: the calls of `KVPressTextGenerationPipeline._forward` (press context "
    "around `model.model(context)`, then `generate_answer`) on the SAME token ids, EOS disabled. Medians of "
    "{repeats} interleaved runs (order alternates each repeat). Ratios < 1: ours is faster.\n"
)
TIME_NOTES = (
    "\nTTFT = context prefill (with compression) + question prefill. Compression: ours = scoring + selection + "
    "copy into the variable-length store (`compress_s`); kvpress = time inside the press's forward hooks. "
    "Decode: mean ms per greedy step after the first token. *Paired ratios*: ours / kvpress of the two runs made "
    "back to back in each repeat (less sensitive to load drift than the ratio of medians). *Same generated "
    "tokens*: the decoded greedy text of both sides is identical (same model, same kept entries)."
)
MEMORY_INTRO = (
    "Bytes of every tensor the cache holds after the context prefill: ours = `VarLenCache.nbytes`-style accounting "
    "(K, V, int32 positions, segment table); kvpress = storage of the DynamicCache's K/V tensors. Uniform presses "
    "prune in kvpress (real saving); AdaKV presses only mask evicted keys (full-size tensors). Peak RSS = process "
    "high-water mark above its level at the start of the document (activations included). *Entries kept* is "
    "logical: kvpress's masked entries still sit in memory and in every decode step's attention matmul.\n"
)


def section_time(
    out: Report, loaded, side: KvpressSide, lengths, cache_size, repeats, new_tokens, methods
) -> list[dict]:
    """Section 2: every method pair at every length; returns one result dict per (method, length)."""
    out(f"\n## 2. Time per document: prefill + compression + question + {new_tokens} tokens\n")
    out(TIME_INTRO.format(cache_size=cache_size, repeats=repeats))
    engines = {m: make_engine(loaded, m, cache_size, new_tokens) for m in methods}
    results = []
    for n in lengths:
        body = n - len(engines[methods[0]].prompts.encode("", ["q"]).context_ids)
        doc = document_of_tokens(loaded.tokenizer, body, seed=n)
        ctx_ids, q_ids = encode_for_kvpress(engines[methods[0]], doc, new_tokens)
        _warm_up(loaded, engines[methods[-1]], side, ctx_ids, q_ids)
        ours, theirs = _interleaved_runs(engines, side, doc, ctx_ids, q_ids, cache_size, repeats, new_tokens)
        results += [_time_result(m, ours[m], theirs[m], len(ctx_ids), len(q_ids)) for m in methods]
    _time_tables(out, results, new_tokens)
    out(TIME_NOTES)
    return results


def _warm_up(loaded, engine, side: KvpressSide, ctx_ids: list[int], q_ids: list[int]) -> None:
    """Both sides once on a short prefix."""
    our_docs_run(engine, [document_of_tokens(loaded.tokenizer, 128, seed=1)], 2)
    side.request("doc", context_ids=ctx_ids[:160], question_ids=q_ids, max_new_tokens=2, press=None)


def _interleaved_runs(engines, side, doc, ctx_ids, q_ids, cache_size, repeats, new_tokens) -> tuple[dict, dict]:
    """Per method, ``repeats`` runs of each side, the order alternating every repeat."""
    ours = {m: [] for m in engines}
    theirs = {m: [] for m in engines}
    for r in range(repeats):
        for m, engine in engines.items():
            for who in ("ours", "kvpress") if r % 2 == 0 else ("kvpress", "ours"):
                if who == "ours":
                    ours[m].append(our_docs_run(engine, [doc], new_tokens))
                    continue
                press = press_spec(m, cache_size)
                theirs[m].append(
                    side.request("doc", context_ids=ctx_ids, question_ids=q_ids, max_new_tokens=new_tokens, press=press)
                )
    return ours, theirs


def _time_result(method: str, o: list[dict], t: list[dict], tokens: int, question_tokens: int) -> dict:
    """Medians of one method pair's runs (o: ours, t: kvpress)."""
    return {
        "method": method,
        "tokens": tokens,
        "question_tokens": question_tokens,
        "ours_total": median([x["total_s"] for x in o]),
        "kv_total": median([x["total_s"] for x in t]),
        "paired_ratio": median([a["total_s"] / b["total_s"] for a, b in zip(o, t)]),
        "ours_ttft": median([x["ttft_s"] for x in o]),
        "kv_ttft": median([x["prefill_s"] + x["question_s"] for x in t]),
        "ours_compress": median([x["compress_s"] for x in o]),
        "kv_compress": median([x["compress_s"] for x in t]),
        "ours_norm": median([x["norm_s"] for x in o]),
        "kv_norm": median([x["norm_s"] for x in t]),
        "ours_exact": o[0]["norm_exact_entries"],
        "ours_decode_ms": median([x["decode_ms"] for x in o]),
        "kv_decode_ms": median([1000 * x["decode_s"] / x["decode_steps"] for x in t]),
        "ours_bytes": o[0]["kv_bytes"],
        "kv_bytes": t[0]["cache_bytes"],
        "ours_entries": o[0]["kv_entries"],
        "kv_entries": t[0]["kv_entries_kept"],
        "full_entries": t[0]["kv_entries_full"],
        "ours_rss": median([x["peak_rss_delta"] for x in o]),
        "kv_rss": median([x["peak_rss_delta"] for x in t]),
        "ours_answer": o[0]["prediction"],
        "kv_answer": t[0]["answer"],
    }


def _time_tables(out: Report, results: list[dict], new_tokens: int) -> None:
    """The per-document table and the TTFT / compression / decode breakdown."""
    rows = [
        [
            r["method"],
            KVPRESS_NAMES[r["method"]],
            r["tokens"],
            f"{r['ours_total']:.2f}",
            f"{r['kv_total']:.2f}",
            fmt_ratio(r["ours_total"], r["kv_total"]),
            f"{r['paired_ratio']:.2f}",
            "yes" if (r["ours_answer"] or "").strip() == (r["kv_answer"] or "").strip() else "no",
        ]
        for r in results
    ]
    heads = ["ours", "kvpress", "context tokens", "ours s/doc", "kvpress s/doc", "ours / kvpress"]
    heads += ["median of paired ratios", f"same {new_tokens} generated tokens"]
    out(table(heads, rows, "llrrrrrl"))
    out("\nBreakdown (medians):\n")
    rows = []
    for r in results:
        compressing = r["method"] != "none"
        rows.append(
            [
                r["method"],
                r["tokens"],
                f"{r['ours_ttft']:.2f} / {r['kv_ttft']:.2f}",
                fmt_ratio(r["ours_ttft"], r["kv_ttft"]),
                f"{r['ours_compress']:.3f} / {r['kv_compress']:.3f}" if compressing else "-",
                fmt_ratio(r["ours_compress"], r["kv_compress"]) if compressing else "-",
                f"{r['ours_decode_ms']:.1f} / {r['kv_decode_ms']:.1f}",
                fmt_ratio(r["ours_decode_ms"], r["kv_decode_ms"]),
            ]
        )
    heads = ["method", "tokens", "TTFT s ours / kvpress", "ratio", "compression s ours / kvpress", "ratio"]
    heads += ["decode ms/token ours / kvpress", "ratio"]
    out(table(heads, rows, "lrrrrrrr"))


def section_memory(out: Report, results: list[dict], cache_size: float, shape) -> None:
    """Section 3: bytes held after the prefill, from section 2's results."""
    out(f"\n## 3. Memory actually held by the KV cache after prefill (cache_size {cache_size})\n")
    out(MEMORY_INTRO)
    rows = []
    for r in results:
        full = r["full_entries"] * shape.kv_entry_bytes_fp32
        measured = r["ours_rss"] == r["ours_rss"] and r["kv_rss"] == r["kv_rss"]  # NaN: not measured
        rows.append(
            [
                r["method"],
                r["tokens"],
                fmt_bytes(full),
                fmt_bytes(r["ours_bytes"]),
                f"{r['ours_bytes'] / full:.3f}",
                fmt_bytes(r["kv_bytes"]),
                f"{r['kv_bytes'] / full:.3f}",
                fmt_ratio(r["ours_bytes"], r["kv_bytes"], 3),
                f"{r['ours_entries'] / r['full_entries']:.3f} / {r['kv_entries'] / r['full_entries']:.3f}",
                f"{fmt_bytes(r['ours_rss'])} / {fmt_bytes(r['kv_rss'])}" if measured else "n/a",
            ]
        )
    heads = ["method", "tokens", "full KV (fp32)", "ours held", "ours / full", "kvpress held", "kvpress / full"]
    heads += ["ours / kvpress", "entries kept ours / kvpress (fraction of full)", "peak RSS delta ours / kvpress"]
    out(table(heads, rows, "lrrrrrrrrr"))
