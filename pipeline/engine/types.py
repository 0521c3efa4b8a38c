"""Plain request/answer records exchanged between the engine and its callers (driver, CLI, eval).

:class:`Answer` declares the output contract's key columns and every column the schema marks as
filled by the engine (:func:`pipeline.data.schema.columns_filled_by` ``ANSWER``), in schema order; a
test checks the two agree, so an engine column added to the schema must be added here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data.schema import ANSWER, KEY, columns_filled_by


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


@dataclass
class Answer:
    """One answered question with what it cost: the output schema's key columns, every column the
    schema marks as filled by the engine (:func:`pipeline.data.schema.columns_filled_by` ``ANSWER``;
    None when unknown, e.g. on an error row; ``tests/data/test_data_schema.py`` checks the two agree,
    names, order and types) and ``setting`` (:class:`Setting`, None = the job's own)."""

    doc_id: str
    question_id: str
    prediction: str | None = None
    context_tokens: int | None = None
    question_tokens: int | None = None
    generated_tokens: int | None = None  # EOS counted
    finish_reason: str | None = None  # stop / length / sentence
    truncated_tokens: int | None = None
    kv_entries_full: int | None = None
    kv_entries_kept: int | None = None
    kv_bytes_full: int | None = None
    kv_bytes_kept: int | None = None
    kv_bytes_reserved: int | None = None
    kv_bytes_used: int | None = None
    ttft_s: float | None = None
    compress_s: float | None = None
    decode_s: float | None = None
    decode_ms_per_token: float | None = None
    decode_batch: float | None = None
    peak_memory_bytes: int | None = None
    device: str | None = None
    answer_nll: float | None = None
    answer_nll_delta: float | None = None
    error: str | None = None
    setting: Setting | None = None

    def as_row(self) -> dict:
        """Output-contract columns of this answer (the setting's columns only when it has one)."""
        row = {name: getattr(self, name) for name in (*columns_filled_by(KEY), *columns_filled_by(ANSWER))}
        if self.setting is not None:
            row.update(self.setting.columns())
        return row
