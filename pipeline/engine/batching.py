"""From requests to left-padded prefill batches: one :class:`Row` per prefilled sequence.

Query-agnostic (default): a request is one row, its context chunk prefilled once and all its
questions answered from that cache. Query-aware: each (request, question) pair is its own row whose
context chunk ends with the question, so the question lies inside the observation window.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kv.allocation import row_budgets
from ..kv.config import CompressionConfig
from .prompts import EncodedPrompt, PromptBuilder
from .types import Request

logger = logging.getLogger(__name__)


@dataclass
class Row:
    """One sequence of a prefill batch: a request, its encoded prompt, the questions answered from it."""

    request: Request
    prompt: EncodedPrompt
    question_indices: list[int]


def check_request(request: Request) -> None:
    """Raise ``ValueError`` for a request that cannot be answered (its rows become error rows)."""
    if not isinstance(request.context, str) or not request.context.strip():
        raise ValueError("context is empty" if isinstance(request.context, str) else "context is not text")
    if not request.questions or any(not isinstance(q, str) or not q.strip() for q in request.questions):
        raise ValueError("missing or empty question")


def rows_for(
    request: Request,
    prompts: PromptBuilder,
    *,
    max_total_tokens: int | None,
    max_new_tokens: int,
    truncate: str,
    query_aware: bool,
) -> list[Row]:
    """The prefill rows of one request (see the module docstring)."""
    check_request(request)
    encode = dict(max_total_tokens=max_total_tokens, reserve_tokens=max_new_tokens, truncate=truncate)
    if not query_aware:
        prompt = prompts.encode(request.context, request.questions, request.answer_prefix, **encode)
        return [Row(request, prompt, list(range(len(request.questions))))]
    rows = []
    for q, question in enumerate(request.questions):
        prompt = prompts.encode(request.context, [question], request.answer_prefix, **encode)
        merged = EncodedPrompt(
            prompt.context_ids + prompt.question_ids[0], [[]], prompt.truncated_tokens, prompt.prefix_tokens
        )
        rows.append(Row(request, merged, [q]))
    return rows


def left_pad(
    sequences: list[list[int]], offsets: torch.Tensor, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and positions (offset + index among real tokens, -1 on padding), left padded."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    pos = torch.full((len(sequences), width), -1, dtype=torch.long)
    for b, seq in enumerate(sequences):
        if seq:
            ids[b, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            pos[b, width - len(seq) :] = torch.arange(len(seq)) + int(offsets[b])
    return ids.to(device), pos.to(device)


def warn_below_window(rows: list[Row], cfg: CompressionConfig) -> None:
    """A ``cache_size`` whose share of a document falls below the observation window keeps the window
    instead (:func:`pipeline.kv.allocation.row_budgets`): say so, with what is kept."""
    if not cfg.compresses or cfg.budget is not None:
        return
    lengths = torch.tensor([len(row.prompt.context_ids) for row in rows])
    kept_per_row, _ = row_budgets(lengths, cfg.cache_size, None, cfg.window)  # the one budget rule
    for row, n, kept in zip(rows, lengths.tolist(), kept_per_row.tolist()):
        share = round(n * cfg.cache_size)
        if share < kept:
            logger.warning(
                "document %r: cache_size %g of its %d context tokens is %d entries per KV head, below the "
                "observation window (%d tokens, always kept); it keeps %d per head (%.1f %% of the context)",
                row.request.doc_id,
                cfg.cache_size,
                n,
                share,
                cfg.window,
                kept,
                100 * kept / max(n, 1),
            )
