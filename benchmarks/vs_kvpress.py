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
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from kvpress_common import (  # noqa: E402
    KVPRESS_NAMES,
    METHODS_HEADWISE,
    KvpressSide,
    Report,
    dir_size,
    ensure_kvpress_venv,
    press_spec,
)
from kvpress_faithfulness import matched_config, section_faithfulness  # noqa: E402
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
    parse_ints,
    table,
)


def make_engine(loaded, method: str, cache_size: float, new_tokens: int, batch_size: int = 1):
    """An Engine with the matched settings that never stops at EOS (exactly ``new_tokens`` tokens)."""
    from pipeline.engine.config import GenerationConfig
    from pipeline.engine.engine import Engine

    cfg = matched_config(method, cache_size=cache_size)
    engine = Engine(loaded, cfg, GenerationConfig(max_new_tokens=new_tokens, batch_size=batch_size))
    engine.eos_ids = set()  # benchmark: decode exactly new_tokens tokens, like the kvpress side
    return engine


def encode_for_kvpress(engine, doc: dict, new_tokens: int) -> tuple[list[int], list[int]]:
    """The exact context and question token ids the engine prefills for ``doc``."""
    prompt = engine.prompts.encode(
        doc["context"],
        [doc["question"]],
        doc["answer_prefix"],
        max_total_tokens=engine.max_context_tokens,
        reserve_tokens=new_tokens,
        truncate=engine.generation.truncate,
    )
    return list(prompt.context_ids), list(prompt.question_ids[0])


def our_docs_run(engine, docs: list[dict], new_tokens: int) -> dict:
    """Run ``docs`` through the engine (batch size as configured); wall time, times and bytes."""
    from pipeline.engine.types import Request
    from pipeline.kv.value_norms import NormStats

    engine.compressor.norm_stats = NormStats()
    requests = [
        Request(
            f"bench-{i}", d["context"], [d["question"]], answer_prefix=d["answer_prefix"], max_new_tokens=new_tokens
        )
        for i, d in enumerate(docs)
    ]
    with PeakRSS() as mem:
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
        "norm_s": engine.compressor.norm_stats.exact_s + engine.compressor.norm_stats.bound_s,
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


def section_time(
    out: Report, loaded, side: KvpressSide, lengths, cache_size, repeats, new_tokens, methods, limits, shape
) -> list[dict]:
    out(f"\n## 2. Time per document: prefill + compression + question + {new_tokens} tokens\n")
    out(
        f"cache_size {cache_size} (kept fraction), matched settings as in section 1. "
        f"Ours: `Engine.generate` (batch_size 1, chat template, EOS disabled). "
        f"kvpress: the calls of `KVPressTextGenerationPipeline._forward` (press context "
        f"around `model.model(context)`, then `generate_answer`) on the SAME token ids, EOS disabled. Medians of "
        f"{repeats} interleaved runs (order alternates each repeat). Ratios < 1: ours is faster.\n"
    )
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
                        theirs[m].append(
                            side.request(
                                "doc",
                                context_ids=ctx_ids,
                                question_ids=q_ids,
                                max_new_tokens=new_tokens,
                                press=press_spec(m, cache_size),
                            )
                        )
        for m in methods:
            o, t = ours[m], theirs[m]
            t_ttft = [x["prefill_s"] + x["question_s"] for x in t]
            t_dec = [1000 * x["decode_s"] / x["decode_steps"] for x in t]
            results.append(
                {
                    "method": m,
                    "tokens": len(ctx_ids),
                    "question_tokens": len(q_ids),
                    "ours_total": median([x["total_s"] for x in o]),
                    "kv_total": median([x["total_s"] for x in t]),
                    "paired_ratio": median([a["total_s"] / b["total_s"] for a, b in zip(o, t)]),
                    "ours_ttft": median([x["ttft_s"] for x in o]),
                    "kv_ttft": median(t_ttft),
                    "ours_compress": median([x["compress_s"] for x in o]),
                    "kv_compress": median([x["compress_s"] for x in t]),
                    "ours_norm": median([x["norm_s"] for x in o]),
                    "kv_norm": median([x["norm_s"] for x in t]),
                    "ours_exact": o[0]["norm_exact_entries"],
                    "ours_decode_ms": median([x["decode_ms"] for x in o]),
                    "kv_decode_ms": median(t_dec),
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
            )
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
    out(
        table(
            [
                "ours",
                "kvpress",
                "context tokens",
                "ours s/doc",
                "kvpress s/doc",
                "ours / kvpress",
                "median of paired ratios",
                f"same {new_tokens} generated tokens",
            ],
            rows,
            "llrrrrrl",
        )
    )
    out("\nBreakdown (medians):\n")
    rows = []
    for r in results:
        rows.append(
            [
                r["method"],
                r["tokens"],
                f"{r['ours_ttft']:.2f} / {r['kv_ttft']:.2f}",
                fmt_ratio(r["ours_ttft"], r["kv_ttft"]),
                f"{r['ours_compress']:.3f} / {r['kv_compress']:.3f}" if r["method"] != "none" else "-",
                fmt_ratio(r["ours_compress"], r["kv_compress"]) if r["method"] != "none" else "-",
                f"{r['ours_decode_ms']:.1f} / {r['kv_decode_ms']:.1f}",
                fmt_ratio(r["ours_decode_ms"], r["kv_decode_ms"]),
            ]
        )
    out(
        table(
            [
                "method",
                "tokens",
                "TTFT s ours / kvpress",
                "ratio",
                "compression s ours / kvpress",
                "ratio",
                "decode ms/token ours / kvpress",
                "ratio",
            ],
            rows,
            "lrrrrrrr",
        )
    )
    out(
        "\nTTFT = context prefill (with compression) + question prefill. Compression: ours = scoring + selection + "
        "copy into the variable-length store (`compress_s`); kvpress = time inside the press's forward hooks. "
        "Decode: mean ms per greedy step after the first token. *Paired ratios*: ours / kvpress of the two runs made "
        "back to back in each repeat (less sensitive to load drift than the ratio of medians). *Same generated "
        "tokens*: the decoded greedy text of both sides is identical (same model, same kept entries)."
    )
    return results


def section_memory(out: Report, results: list[dict], cache_size: float, shape) -> None:
    out(f"\n## 3. Memory actually held by the KV cache after prefill (cache_size {cache_size})\n")
    out(
        "Bytes of every tensor the cache holds after the context prefill: ours = `VarLenCache.nbytes`-style accounting "
        "(K, V, int32 positions, segment table); kvpress = storage of the DynamicCache's K/V tensors. Uniform presses "
        "prune in kvpress (real saving); AdaKV presses only mask evicted keys (full-size tensors). Peak RSS = process "
        "high-water mark above its level at the start of the document (activations included). *Entries kept* is "
        "logical: kvpress's masked entries still sit in memory and in every decode step's attention matmul.\n"
    )
    rows = []
    for r in results:
        full = r["full_entries"] * shape.kv_entry_bytes_fp32
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
                f"{fmt_bytes(r['ours_rss'])} / {fmt_bytes(r['kv_rss'])}"
                if r["ours_rss"] == r["ours_rss"] and r["kv_rss"] == r["kv_rss"]
                else "n/a",
            ]
        )
    out(
        table(
            [
                "method",
                "tokens",
                "full KV (fp32)",
                "ours held",
                "ours / full",
                "kvpress held",
                "kvpress / full",
                "ours / kvpress",
                "entries kept ours / kvpress (fraction of full)",
                "peak RSS delta ours / kvpress",
            ],
            rows,
            "lrrrrrrrrr",
        )
    )


def section_batch(
    out: Report, loaded, side: KvpressSide, n: int, batch: int, cache_size, repeats, new_tokens, shape
) -> None:
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
                    rep = side.request(
                        "doc",
                        context_ids=ctx,
                        question_ids=q,
                        max_new_tokens=new_tokens,
                        press=press_spec(method, cache_size),
                    )
                    total += rep["total_s"]
                    biggest = max(biggest, rep["cache_bytes"])
                walls[who].append(total)
                held[who] = biggest
    kv = median(walls["kvpress one by one"])
    rows = [
        [
            who,
            ", ".join(str(len(c)) for c, _ in encoded),
            f"{median(v):.2f}",
            fmt_ratio(median(v), kv),
            f"{median([a / b for a, b in zip(v, walls['kvpress one by one'])]):.2f}",
            fmt_bytes(held[who]) if held.get(who) else "n/a",
        ]
        for who, v in walls.items()
    ]
    out(
        table(
            [
                "setup",
                "context tokens",
                f"wall s for {batch} docs (median of {repeats})",
                "ratio to kvpress",
                "median of paired ratios",
                "KV bytes held at once (max)",
            ],
            rows,
            "lrrrrr",
        )
    )
    # kvpress batched CriticalAdaKV, once, on equal-length rows
    m = min(len(c) for c, _ in encoded)
    attempt = side.request("batch_try", rows=[c[:m] for c, _ in encoded], press=press_spec(method, cache_size))
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
    rows = []
    for r in results:
        extra = (r["question_tokens"] + new_tokens / 2) * shape.layers * shape.kv_heads
        ours_read = r["ours_entries"] + extra
        kv_read = (
            r["full_entries"] if r["method"] in METHODS_HEADWISE or r["method"] == "none" else r["kv_entries"]
        ) + extra
        ob, _, _ = decode_bound_s(shape, ours_read, limits)
        kb, _, _ = decode_bound_s(shape, kv_read, limits)
        rows.append(
            [
                r["method"],
                r["tokens"],
                f"{1000 * ob:.1f}",
                f"{r['ours_decode_ms']:.1f}",
                f"{1000 * ob / r['ours_decode_ms']:.0%}",
                f"{1000 * kb:.1f}",
                f"{r['kv_decode_ms']:.1f}",
                f"{1000 * kb / r['kv_decode_ms']:.0%}",
            ]
        )
    out(
        table(
            [
                "method",
                "tokens",
                "ours bound ms",
                "ours measured ms",
                "ours achieved",
                "kvpress bound ms",
                "kvpress measured ms",
                "kvpress achieved",
            ],
            rows,
            "lrrrrrrr",
        )
    )
    crit = [r for r in results if r["method"].startswith("criticalkv")]
    if crit:
        out(
            f"\nCriticalKV norms: bound = FLOPs / {limits.matmul_gflops:.0f} GFLOP/s. "
            "Ours computes exact L1 norms only for the stage-2 candidates that can still make the top-k "
            "(count below) plus a D x D Gram bound for every "
            "entry; kvpress computes the exact norm of every entry of every layer (a Python loop per query head). "
            "Measured: ours = time inside the norm functions; kvpress = time inside `CriticalKVPress.vwl1norm`.\n"
        )
        rows = []
        for r in crit:
            n_entries = r["tokens"] * shape.layers * shape.kv_heads
            of = exact_norm_flops(shape, r["ours_exact"]) + bound_norm_flops(shape, n_entries)
            kf = full_norm_flops(shape, r["tokens"])
            ob, kb = of / (limits.matmul_gflops * 1e9), kf / (limits.matmul_gflops * 1e9)
            rows.append(
                [
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
                    f"{r['ours_norm'] / r['ours_compress']:.0%} / {r['kv_norm'] / r['kv_compress']:.0%}"
                    if r["ours_compress"] and r["kv_compress"]
                    else "n/a",
                ]
            )
        out(
            table(
                [
                    "method",
                    "tokens",
                    "ours exact norms / entries",
                    "ours GFLOP",
                    "ours bound ms",
                    "ours measured ms",
                    "ours achieved",
                    "kvpress GFLOP",
                    "kvpress bound ms",
                    "kvpress measured ms",
                    "kvpress achieved",
                    "norm time ours / kvpress",
                    "norms' share of compression time ours / kvpress",
                ],
                rows,
                "lrrrrrrrrrrrr",
            )
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096", help="context tokens for sections 2, 3, 5")
    p.add_argument("--faith-lengths", default="2048,4096", help="context tokens for section 1")
    p.add_argument("--faith-dtypes", default="float32,bfloat16", help="model dtypes (both sides) for section 1")
    p.add_argument(
        "--bf16-max-tokens",
        type=int,
        default=2048,
        help="section 1: non-fp32 rows only up to this length (slow on CPU)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cache-size", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument(
        "--batch-length", type=int, default=None, help="longest document of the batch (default: min of --lengths)"
    )
    p.add_argument("--methods", default="none,snapkv,criticalkv-snapkv,criticalkv-adakv-snapkv")
    p.add_argument("--sections", default="1,2,3,4,5")
    p.add_argument("--per-layer", action="store_true", help="section 1: print per-layer mean Jaccard")
    p.add_argument("--kvpress-venv", default=None)
    p.add_argument("--setup-only", action="store_true", help="create the kvpress venv and exit")
    p.add_argument(
        "--out", default=str(RESULTS_DIR / "vs_kvpress.md"), help="also write the Markdown here ('' = don't)"
    )
    args = p.parse_args(argv)

    info = ensure_kvpress_venv(Path(args.kvpress_venv) if args.kvpress_venv else None)
    if args.setup_only:
        size = info["size"] if info["size"] is not None else dir_size(Path(info["python"]).parents[1])
        how = f"created in {info['seconds']:.0f} s" if info["created"] else "already there"
        print(f"kvpress venv: {info['python']} ({how}, {size / 2**30:.2f} GiB)")
        return

    from common import load_smollm2

    from pipeline.engine.config import ModelConfig
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
        out(
            f"- kvpress side: kvpress {hello['kvpress']}, transformers {hello['transformers']}, torch {hello['torch']} "
            f"({hello['threads']} threads, attention `{hello['attn_implementation']}`), "
            f"venv `{Path(info['python']).parents[1]}`"
        )
        out(f"- both sides: fp32 weights from `{model_dir}`, same token ids")
        limits = measure_limits() if 5 in sections else None
        if 1 in sections:
            section_faithfulness(
                out,
                loaded,
                side,
                parse_ints(args.faith_lengths),
                args.cache_size,
                [d for d in args.faith_dtypes.split(",") if d],
                args.per_layer,
                args.bf16_max_tokens,
            )
        results = []
        if sections & {2, 3, 5}:
            methods = [m for m in args.methods.split(",") if m]
            results = section_time(
                out,
                loaded,
                side,
                parse_ints(args.lengths),
                args.cache_size,
                args.repeats,
                args.new_tokens,
                methods,
                limits,
                shape,
            )
        if 3 in sections:
            section_memory(out, results, args.cache_size, shape)
        if 4 in sections:
            section_batch(
                out,
                loaded,
                side,
                args.batch_length or min(parse_ints(args.lengths)),
                args.batch,
                args.cache_size,
                args.repeats,
                args.new_tokens,
                shape,
            )
        if 5 in sections and results:
            limits = measure_limits().best(limits)  # best of start and end of the run
            section_limits(out, results, limits, shape, args.new_tokens)
    out.write(Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
