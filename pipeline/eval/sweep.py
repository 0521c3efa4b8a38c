"""Compression sweeps: which documents and which settings.

A sweep runs every (method, cache size) on the same RULER-style documents. The engine prefills
each context once and derives every setting's compressed cache from that prefill
(:meth:`pipeline.engine.engine.Engine.generate_sweep`), so the sweep costs one prefill per
document plus, per setting, a compression and the answer's decode. Answers are scored with
:mod:`pipeline.eval.scoring`.

Settings: every method at every cache size below 1.0, plus ONE full-cache setting (method
``none``, cache size 1.0) as the reference, whatever methods were asked for (at cache size 1.0
every method keeps everything and equals ``none``, which the test suite checks).
"""

from __future__ import annotations

from collections.abc import Callable

from ..kv.config import CompressionConfig, method_names
from .ruler import MAX_NEW_TOKENS, TASKS, generate_task
from .summaries import SUMMARY_TASK, summary_documents


def sweep_settings(methods: list[str], cache_sizes: list[float], base: CompressionConfig) -> list[CompressionConfig]:
    """One CompressionConfig per (method, cache size < 1) plus the full-cache reference."""
    valid = method_names()
    unknown = [m for m in methods if m not in valid]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; choose from {', '.join(valid)}")
    bad = [c for c in cache_sizes if not 0.0 < c <= 1.0]
    if bad:
        raise ValueError(f"cache_sizes: {bad} outside (0, 1]")
    settings = [base.with_method("none", cache_size=1.0, budget=None)]
    for method in methods:
        if method == "none":
            continue
        for size in sorted(c for c in cache_sizes if c < 1.0):
            settings.append(base.with_method(method, cache_size=size, budget=None))
    return settings


def token_counter(tokenizer) -> Callable[[str], int]:
    """Token count of a text with the evaluated model's tokenizer (no special tokens)."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def ruler_documents(
    tasks: list[str],
    length_tokens: int,
    samples: int,
    count_tokens: Callable[[str], int],
    seed: int = 0,
    max_new_tokens: int | None = None,
) -> list[dict]:
    """Normalised documents (one question each) for the given RULER tasks, with ``task``,
    ``metric`` and ``references`` kept for scoring. ``max_new_tokens`` caps RULER's per-task
    generation lengths (RULER's 128 for needles is far more than a 7-digit answer needs)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"tasks: unknown {unknown}; choose from {', '.join([*TASKS, SUMMARY_TASK])}")
    docs = []
    for task in tasks:
        for row in generate_task(task, length_tokens, count_tokens, samples, seed):
            limit = MAX_NEW_TOKENS[task] if max_new_tokens is None else min(max_new_tokens, MAX_NEW_TOKENS[task])
            docs.append(
                {
                    "doc_id": row["doc_id"],
                    "context": row["context"],
                    "questions": [row["question"]],
                    "question_ids": ["0"],
                    "answer_prefix": row["answer_prefix"],
                    "references": [list(row["reference"])],
                    "max_new_tokens": limit,
                    "task": task,
                    "metric": row["metric"],
                }
            )
    return docs


def sweep_documents(
    tasks: list[str],
    length_tokens: int,
    samples: int,
    count_tokens: Callable[[str], int],
    seed: int = 0,
    max_new_tokens: int | None = None,
    summary_tokens: int = 128,
) -> list[dict]:
    """RULER documents for the RULER tasks among ``tasks`` and essay summaries for ``summary_essay``
    (generation limit ``summary_tokens``; ``max_new_tokens`` caps the RULER tasks only)."""
    ruler = [t for t in tasks if t != SUMMARY_TASK]
    docs = ruler_documents(ruler, length_tokens, samples, count_tokens, seed, max_new_tokens) if ruler else []
    if SUMMARY_TASK in tasks:
        docs += summary_documents(length_tokens, samples, count_tokens, seed, summary_tokens)
    return docs
