"""Compression sweeps: which documents and which settings.

A sweep runs every (method, cache size) on the same RULER-style documents. The engine prefills
each context once and derives every setting's compressed cache from that prefill
(:meth:`pipeline.engine.engine.Engine.generate_sweep`), so the sweep costs one prefill per
document plus, per setting, a compression and the answer's decode. Answers are scored with
:mod:`pipeline.eval.scoring`.

Settings: every method at every cache size below 1.0, plus ONE full-cache setting (method
``none``, cache size 1.0) as the reference, whatever methods were asked for (at cache size 1.0
every method keeps everything and equals ``none``, which the test suite checks).

Variants: a method entry ``NAME[knob=value,...]`` sweeps ``NAME`` with other values of its part
knobs (``snapkv[window=64,kernel=5,pooling=avg]``), side by side with ``NAME`` itself from the same
prefill; its rows carry the label (knobs sorted, values as validated) in the ``method`` column.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ..kv.config import CompressionConfig, CompressionKnobs, method_names
from .ruler import MAX_NEW_TOKENS, TASKS, generate_task
from .summaries import SUMMARY_TASK, summary_documents


def parse_variant(entry: str) -> tuple[str, dict[str, str]]:
    """``"snapkv[window=64,pooling=avg]"`` -> ``("snapkv", {"window": "64", "pooling": "avg"})``;
    a plain method name has no overrides."""
    text = entry.strip()
    if "[" not in text and "]" not in text:
        return text, {}
    name, bracket, rest = text.partition("[")
    if not bracket or not rest.endswith("]") or "[" in rest or "]" in rest[:-1]:
        raise ValueError(f"methods: {entry!r} is not NAME or NAME[knob=value,...]")
    overrides: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest[:-1].split(","))):
        knob, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not knob or not value:
            raise ValueError(f"methods: {entry!r}: {item!r} is not knob=value")
        if knob in overrides:
            raise ValueError(f"methods: {entry!r} sets {knob} twice")
        overrides[knob] = value
    if not overrides:
        raise ValueError(f"methods: {entry!r} has empty brackets")
    return name.strip(), overrides


def _variant_config(entry: str, size: float, knobs: CompressionKnobs) -> CompressionConfig:
    """The validated setting of one ``--methods`` entry at one cache size."""
    name, overrides = parse_variant(entry)
    variable = set(CompressionKnobs.model_fields)  # a variant changes knobs only, never the method choice
    unknown = sorted(set(overrides) - variable)
    if unknown:
        raise ValueError(f"methods: {entry!r}: {', '.join(unknown)} cannot vary; knobs: {', '.join(sorted(variable))}")
    try:
        config = knobs.setting(name, size, **overrides)
    except ValueError as exc:  # pydantic's ValidationError names the field
        raise ValueError(f"methods: {entry!r}: {exc}") from None
    if not overrides:
        return config
    label = ",".join(f"{knob}={_spelled(getattr(config, knob))}" for knob in sorted(overrides))
    return config.with_method(variant=label)


def _spelled(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def sweep_settings(methods: list[str], cache_sizes: list[float], knobs: CompressionKnobs) -> list[CompressionConfig]:
    """One CompressionConfig per (method entry, cache size < 1) plus the full-cache reference, each
    with ``knobs``; an entry is a method name or a variant ``NAME[knob=value,...]`` (see the module
    docstring)."""
    valid = method_names()
    unknown = [m for m in methods if parse_variant(m)[0] not in valid]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; choose from {', '.join(valid)}")
    bad = [c for c in cache_sizes if not 0.0 < c <= 1.0]
    if bad:
        raise ValueError(f"cache_sizes: {bad} outside (0, 1]")
    settings = [knobs.setting("none", 1.0)]
    for entry in methods:
        if entry.strip() == "none":
            continue
        for size in sorted(c for c in cache_sizes if c < 1.0):
            settings.append(_variant_config(entry, size, knobs))
    twice = sorted({label for (label, _size), n in Counter((s.label, s.cache_size) for s in settings).items() if n > 1})
    if twice:
        raise ValueError(f"methods: {', '.join(twice)} swept twice (their rows would share ids)")
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
