"""Our side of ``benchmarks/kvpress/vs_kvpress.py``: the Engine with kvpress-matched settings, the exact token
ids it prefills (handed to the kvpress side), and one timed run over documents."""

from __future__ import annotations

import time

from benchmarks.kvpress.faithfulness import matched_config
from benchmarks.roofline import PeakRSS


def make_engine(loaded, method: str, cache_size: float, new_tokens: int, batch_size: int = 1):
    """An Engine with the matched settings that never stops at EOS (exactly ``new_tokens`` tokens)."""
    from pipeline.engine.config import GenerationConfig
    from pipeline.engine.engine import Engine

    cfg = matched_config(method, cache_size=cache_size)
    engine = Engine(loaded, cfg, GenerationConfig(max_new_tokens=new_tokens, batch_size=batch_size, continuous=False))
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
