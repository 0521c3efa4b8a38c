"""Plain request/answer records exchanged between the engine and its callers (driver, CLI, eval)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Request:
    """One document and the questions to answer from its (compressed) cache.

    The context is prefilled once; every question is answered from that same cache, its tokens
    positioned after the full original context. ``answer_prefix`` (e.g. ``"The answer is"``) is
    placed after the chat template's assistant header and counted in the question tokens.
    ``instruction`` requests (summaries) use an empty question list and ``questions=[instruction]``.
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


@dataclass
class Answer:
    """One answered question with what it cost (column names follow the output contract)."""

    doc_id: str
    question_id: str
    prediction: str | None = None
    context_tokens: int = 0
    question_tokens: int = 0
    generated_tokens: int = 0
    kv_entries_full: int = 0
    kv_entries_kept: int = 0
    kv_bytes_full: int = 0
    kv_bytes_kept: int = 0
    ttft_s: float | None = None
    compress_s: float | None = None
    decode_s: float | None = None
    decode_ms_per_token: float | None = None
    peak_memory_bytes: int | None = None
    device: str = ""
    truncated_tokens: int = 0
    cache_size: float | None = None  # set when this row used another cache size (OOM retry)
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def as_row(self) -> dict:
        """Output-contract columns of this answer (``extra`` is for in-process callers only;
        ``cache_size`` appears only when it differs from the job's, i.e. after an OOM retry)."""
        row = asdict(self)
        row.pop("extra")
        if row["cache_size"] is None:
            row.pop("cache_size")
        return row
