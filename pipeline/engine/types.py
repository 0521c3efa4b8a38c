"""Plain request/answer records exchanged between the engine and its callers (driver, CLI, eval).

:class:`Answer`'s fields are generated from the output contract: the key columns and every column
the schema marks as filled by the engine (:func:`pipeline.data.schema.columns_filled_by`
``ANSWER``), so adding an engine column to the schema adds it here and to every output row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..data.schema import ANSWER, KEY, columns_filled_by, python_type


@dataclass
class Request:
    """One document and the questions to answer from its (compressed) cache.

    The context is prefilled once; every question is answered from that same cache, its tokens
    positioned after the full original context. ``answer_prefix`` (e.g. ``"The answer is"``) is
    placed after the chat template's assistant header and counted in the question tokens.
    Summaries give the instruction as the only question.
    """

    doc_id: str
    context: str
    questions: list[str]
    question_ids: list[str] | None = None
    answer_prefix: str = ""
    max_new_tokens: int | None = None  # None: the engine's GenerationConfig default

    def __post_init__(self) -> None:
        if self.question_ids is None:
            self.question_ids = [str(i) for i in range(len(self.questions))]
        if len(self.question_ids) != len(self.questions):
            raise ValueError(
                f"doc {self.doc_id!r}: {len(self.questions)} questions but {len(self.question_ids)} question_ids"
            )


@dataclass(frozen=True)
class Setting:
    """The compression setting an answer was produced with, when it is not the job's own
    (a sweep's settings; an out-of-memory retry at a smaller cache size). It fills the output's
    ``method`` / ``cache_size`` / ``budget`` columns and, in sweeps, qualifies the question id."""

    method: str
    cache_size: float
    budget: int | None = None

    @property
    def label(self) -> str:
        return f"{self.method}@{self.cache_size:g}" + (f"/b{self.budget}" if self.budget is not None else "")

    def question_id(self, base: str) -> str:
        """The output row key of question ``base`` answered with this setting (sweeps)."""
        return f"{base}|{self.method}|{self.cache_size:g}" + (f"|b{self.budget}" if self.budget is not None else "")

    def columns(self) -> dict:
        return {"method": self.method, "cache_size": self.cache_size, "budget": self.budget}


def row_question_ids(question_ids: list[str], sweep: list[Setting]) -> list[str]:
    """The output row keys of a document's questions: the ids themselves, or each id under every
    swept setting (setting-major)."""
    if not sweep:
        return list(question_ids)
    return [setting.question_id(q) for setting in sweep for q in question_ids]


def _as_row(self) -> dict:
    """Output-contract columns of this answer (the setting's columns only when it has one)."""
    row = {name: getattr(self, name) for name in (*columns_filled_by(KEY), *columns_filled_by(ANSWER))}
    if self.setting is not None:
        row.update(self.setting.columns())
    return row


Answer = dataclasses.make_dataclass(
    "Answer",
    [(name, str) for name in columns_filled_by(KEY)]
    + [(name, python_type(name) | None, dataclasses.field(default=None)) for name in columns_filled_by(ANSWER)]
    + [("setting", Setting | None, dataclasses.field(default=None))],
    namespace={"as_row": _as_row, "__module__": __name__},
)
Answer.__doc__ = (
    "One answered question with what it cost: ``doc_id``, ``question_id``, the output schema's engine "
    f"columns ({', '.join(columns_filled_by(ANSWER))}; None when unknown, e.g. on an error row) and "
    "``setting`` (:class:`Setting`, None = the job's own)."
)
