"""Documents for the perturbation diagnostics (:mod:`pipeline.eval.perturbation`): a context and
the later tokens whose attention is measured (RULER questions with their answers, or plain-text
continuations of the essay haystack)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..engine.prompts import PromptBuilder
from .ruler import generate_task
from .ruler_data import essay_words


@dataclass
class Document:
    """A context and the later tokens whose attention is measured."""

    doc_id: str
    context_ids: list[int]
    query_ids: list[int]
    query_kind: str  # "question" | "continuation"


def question_documents(
    tokenizer, length: int, samples: int, seed: int = 0, task: str = "niah_single_2", use_chat_template: bool = True
) -> list[Document]:
    """RULER-style documents (default ``niah_single_2``: essay haystack, one number needle).

    The context chunk is encoded as the engine does (:class:`~pipeline.engine.prompts.PromptBuilder`);
    the later tokens are the question chunk (question + chat template tail + answer prefix) followed
    by the reference answer, teacher-forced (`` " " + reference[0]``).
    """
    builder = PromptBuilder(tokenizer, use_chat_template)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    docs = []
    for row in generate_task(task, length, count, samples, seed):
        prompt = builder.encode(row["context"], [row["question"]], row["answer_prefix"])
        answer = list(tokenizer(" " + row["reference"][0], add_special_tokens=False)["input_ids"])
        docs.append(Document(row["doc_id"], prompt.context_ids, prompt.question_ids[0] + answer, "question"))
    return docs


def continuation_documents(
    tokenizer, length: int, samples: int, query_tokens: int = 64, seed: int = 0
) -> list[Document]:
    """Plain-text documents from the essay haystack: the first ``length`` tokens are the context, the
    next ``query_tokens`` tokens of the same text are the later queries (language-model continuation).
    Each sample starts at a seeded random word of the essays."""
    words = list(essay_words())
    words = words + words  # a sample may start near the end: wrap around
    rng = random.Random(seed)
    need = length + query_tokens
    docs = []
    for i in range(samples):
        start = rng.randrange(len(words) // 2)
        take = max(need, 64)
        while True:
            ids = list(tokenizer(" ".join(words[start : start + take]), add_special_tokens=True)["input_ids"])
            if len(ids) >= need or take >= len(words) // 2:
                break
            take = int(take * 1.5) + 16
        if len(ids) < need:
            raise ValueError(f"the essay haystack is too short for {need} tokens")
        docs.append(Document(f"continuation-{length}-s{seed}-{i:05d}", ids[:length], ids[length:need], "continuation"))
    return docs
