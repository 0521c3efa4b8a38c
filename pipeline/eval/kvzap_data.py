"""Calibration documents for the learned scorer (``jobs/calibrate_kvzap.py``): generated offline,
seeded, in four kinds so that the predictor sees more than one sort of text.

``ruler``    a RULER haystack with its needles (niah variants, variable tracking, common words),
             from :mod:`pipeline.eval.ruler` with the calibration's own seed (not the sweeps')
``essay``    a stretch of a Paul Graham essay (the haystack text of RULER and of the summaries)
``numbers``  ledger-like lines of ids, dates, amounts and codes (digit-heavy text)
``code``     Python-like functions built from word lists (identifiers, operators, indentation)

Each document is fitted to a target length in the model's tokens (the context alone; calibration is
query-agnostic). Documents are dicts ``{doc_id, kind, length, context}``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .ruler import generate_sample
from .ruler_data import adjectives, nouns, verbs
from .summaries import essays, fit_text, longest_prefix

KINDS = ("ruler", "essay", "numbers", "code")
RULER_TASKS = ("niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_single_1", "vt", "cwe")


def _numbers_text(rng: random.Random, lines: int) -> str:
    out = []
    for _ in range(lines):
        out.append(
            f"Record {rng.randint(1000, 99999)}: account {rng.randint(10**6, 10**7 - 1)} on "
            f"{rng.randint(2001, 2029)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}, amount "
            f"{rng.randint(1, 99999)}.{rng.randint(0, 99):02d}, code {rng.choice('ABCDEFGHJK')}{rng.randint(100, 999)}."
        )
    return "\n".join(out)


def _code_text(rng: random.Random, functions: int) -> str:
    words = [w for w in nouns() + verbs() if w.isalpha()][:2000]
    out = []
    for _ in range(functions):
        name = f"{rng.choice(verbs())}_{rng.choice(nouns())}".lower()
        args = [rng.choice(words).lower() for _ in range(rng.randint(1, 3))]
        body = [f"def {name}({', '.join(args)}):"]
        for _ in range(rng.randint(2, 6)):
            target, source = rng.choice(words).lower(), rng.choice(args)
            op = rng.choice(["+", "-", "*", "//", "%"])
            body.append(f"    {target} = {source} {op} {rng.randint(1, 512)}")
            if rng.random() < 0.3:
                body.append(f"    if {target} > {rng.randint(0, 99)}:\n        return {target}")
        body.append(f"    return {rng.choice(args)}  # {rng.choice(adjectives())} {rng.choice(nouns())}")
        out.append("\n".join(body))
    return "\n\n".join(out)


def _grow(make: Callable[[int], str], length: int, count_tokens: Callable[[str], int]) -> str:
    """The largest ``make(units)`` within ``length`` tokens (units grow until the text is too long)."""
    units = 4
    text = make(units)
    while count_tokens(text) < length:
        units *= 2
        text = make(units)
    return longest_prefix(text.split("\n"), "\n", length, count_tokens)


def calibration_document(kind: str, length: int, index: int, count_tokens: Callable[[str], int], seed: int) -> dict:
    """One document of ``kind`` fitted to ``length`` context tokens."""
    rng = random.Random(f"kvzap/{seed}/{kind}/{length}/{index}")
    if kind == "ruler":
        task = RULER_TASKS[index // len(KINDS) % len(RULER_TASKS)]
        try:
            context = generate_sample(task, length, count_tokens, seed=seed + 1000, index=index)["context"]
        except ValueError:  # a task whose template does not fit this length: a single needle instead
            context = generate_sample("niah_single_2", length, count_tokens, seed=seed + 1000, index=index)["context"]
    elif kind == "essay":
        texts = essays()
        text = " ".join(t for _, t in rng.sample(texts, 3))
        start = rng.randrange(0, max(1, len(text) // 3))
        context = fit_text(text[start:], length, count_tokens)
    elif kind == "numbers":
        context = _grow(lambda units: _numbers_text(random.Random(rng.random()), units), length, count_tokens)
    elif kind == "code":
        state = rng.random()
        context = _grow(lambda units: _code_text(random.Random(state), units), length, count_tokens)
    else:
        raise ValueError(f"unknown calibration document kind {kind!r}; choose from {', '.join(KINDS)}")
    return {"doc_id": f"kvzap-{kind}-{length}-s{seed}-{index:04d}", "kind": kind, "length": length, "context": context}


def calibration_documents(
    lengths: list[int], per_length: int, count_tokens: Callable[[str], int], seed: int = 0
) -> list[dict]:
    """``per_length`` documents per length, cycling through :data:`KINDS`."""
    docs = []
    for length in lengths:
        for i in range(per_length):
            docs.append(calibration_document(KINDS[i % len(KINDS)], length, i, count_tokens, seed))
    return docs
