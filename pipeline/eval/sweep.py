"""Compression sweeps: which documents, which settings, and how each answer is scored.

A sweep runs every (method, cache size) on the same RULER-style documents. The engine prefills
each context once and derives every setting's compressed cache from that prefill
(:meth:`pipeline.engine.engine.Engine.generate_sweep`), so the sweep costs one prefill per
document plus, per setting, a compression and the answer's decode.

Settings: every method at every cache size below 1.0, plus ONE full-cache setting (method
``none``, cache size 1.0) as the reference, whatever methods were asked for (at cache size 1.0
every method keeps everything and equals ``none``, which the test suite checks).
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import METHODS, CompressionConfig
from .longbench import LONGBENCH_DATASET_METRIC
from .metrics import score
from .ruler import MAX_NEW_TOKENS, TASK_METRIC, TASKS, generate_task

SEPARATOR = "|"


def sweep_settings(methods: list[str], cache_sizes: list[float], base: CompressionConfig) -> list[CompressionConfig]:
    """One CompressionConfig per (method, cache size < 1) plus the full-cache reference."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    bad = [c for c in cache_sizes if not 0.0 < c <= 1.0]
    if bad:
        raise ValueError(f"cache_sizes: {bad} outside (0, 1]")
    fields = base.model_dump()
    settings = [CompressionConfig(**{**fields, "method": "none", "cache_size": 1.0, "budget": None})]
    for method in methods:
        if method == "none":
            continue
        for size in sorted(c for c in cache_sizes if c < 1.0):
            settings.append(CompressionConfig(**{**fields, "method": method, "cache_size": size, "budget": None}))
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
        raise ValueError(f"tasks: unknown {unknown}; choose from {', '.join(TASKS)}")
    docs = []
    for task in tasks:
        for row in generate_task(task, length_tokens, count_tokens, samples, seed):
            limit = MAX_NEW_TOKENS[task] if max_new_tokens is None else min(max_new_tokens, MAX_NEW_TOKENS[task])
            docs.append({
                "doc_id": row["doc_id"], "context": row["context"], "questions": [row["question"]],
                "question_ids": ["0"], "answer_prefix": row["answer_prefix"], "references": [list(row["reference"])],
                "max_new_tokens": limit, "task": task, "metric": row["metric"],
            })
    return docs


def score_prediction(metric: str | None, prediction: str | None, references: list[str] | None) -> float | None:
    """Score of one answer, or None when there is nothing to score against."""
    if not metric or not references or prediction is None:
        return None
    return score(metric, prediction, references)


def setting_key(config: CompressionConfig) -> str:
    """``method|cache_size`` naming one swept setting inside question ids."""
    return f"{config.method}{SEPARATOR}{config.cache_size:g}"


def expand_for_sweep(docs: list[dict], settings: list[CompressionConfig]) -> list[dict]:
    """One question entry per (question, setting): ids ``<question_id>|<method>|<cache_size>``, so
    every (document, question, setting) is one output row with its own key (resume, dedupe and the
    exactly-once check work per setting)."""
    out = []
    for doc in docs:
        refs = doc.get("references") or [None] * len(doc["questions"])
        expanded = {"questions": [], "question_ids": [], "references": []}
        for setting in settings:
            for qid, question, ref in zip(doc["question_ids"], doc["questions"], refs):
                expanded["questions"].append(question)
                expanded["question_ids"].append(f"{qid}{SEPARATOR}{setting_key(setting)}")
                expanded["references"].append(ref)
        out.append({**doc, **expanded})
    return out


def split_question_id(question_id: str) -> tuple[str, str | None]:
    """``'0|snapkv|0.2'`` -> ``('0', 'snapkv|0.2')``; a plain id -> ``(id, None)``."""
    base, sep, key = question_id.partition(SEPARATOR)
    return (base, key) if sep else (question_id, None)


def metric_for_task(task: str | None) -> str | None:
    """The metric of a RULER task or LongBench dataset name (None when unknown)."""
    if not task:
        return None
    return TASK_METRIC.get(task) or LONGBENCH_DATASET_METRIC.get(task)
