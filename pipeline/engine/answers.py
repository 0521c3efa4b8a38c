"""Answer records from one batch's round results and its compressed context's cost."""

from __future__ import annotations

from dataclasses import dataclass

from .batching import Row
from .decoding import RoundResult
from .types import Answer, Setting


@dataclass
class ContextCost:
    """What one batch's compressed context cost: per row kept entries and bytes (lists of B ints),
    plus the batch's times and peak memory."""

    entries: list[int]
    kept_bytes: list[int]
    ttft_base_s: float  # context prefill (+ this setting's compression in sweeps)
    compress_s: float
    peak_memory_bytes: int | None


@dataclass
class ModelShape:
    """What the full-cache figures of an answer depend on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    device_label: str


def make_answers(
    rows: list[Row],
    ctx_len: list[int],
    per_round: list[list[RoundResult]],
    cost: ContextCost,
    shape: ModelShape,
    setting: Setting | None = None,
    reference: list[list[RoundResult]] | None = None,
) -> list[Answer]:
    """One :class:`Answer` per (row, question), rows first then their questions in order.

    ``reference``: the full cache's round results of the same rows (sweeps); with it, each answer's
    ``answer_nll_delta`` is its ``answer_nll`` minus the full cache's on the same question."""
    answers = []
    for b, row in enumerate(rows):
        full_entries = int(ctx_len[b]) * shape.num_layers * shape.num_kv_heads
        for r, q in enumerate(row.question_indices):
            result = per_round[r][b]
            full = reference[r][b].answer_nll if reference is not None else None
            delta = result.answer_nll - full if result.answer_nll is not None and full is not None else None
            answers.append(
                Answer(
                    doc_id=row.request.doc_id,
                    question_id=row.request.question_ids[q],
                    prediction=result.text,
                    context_tokens=int(ctx_len[b]),
                    question_tokens=result.question_tokens,
                    generated_tokens=result.generated_tokens,
                    finish_reason=result.finish_reason,
                    truncated_tokens=row.prompt.truncated_tokens,
                    kv_entries_full=full_entries,
                    kv_entries_kept=int(cost.entries[b]),
                    kv_bytes_full=full_entries * 2 * shape.head_dim * shape.itemsize,
                    kv_bytes_kept=int(cost.kept_bytes[b]),
                    kv_bytes_reserved=result.kv_bytes_reserved,
                    kv_bytes_used=result.kv_bytes_used,
                    ttft_s=cost.ttft_base_s + result.question_s,
                    compress_s=cost.compress_s,
                    decode_s=result.decode_s,
                    decode_ms_per_token=(1000.0 * result.decode_s / result.steps) if result.steps else None,
                    decode_batch=result.decode_batch,
                    peak_memory_bytes=cost.peak_memory_bytes,
                    device=shape.device_label,
                    answer_nll=result.answer_nll,
                    answer_nll_delta=delta,
                    setting=setting,
                )
            )
    return answers
