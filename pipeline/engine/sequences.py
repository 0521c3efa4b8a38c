"""What a continuous decode batch (:mod:`pipeline.engine.continuous`) decodes: one :class:`Sequence`
per row (a document, or one setting's compressed copy of a document in a sweep), and the sources that
give a row its compressed context when it is admitted.

- :class:`DocumentSource` (the jobs' continuous batch): the row's own prefill and compression, alone;
  its footprint is estimated before the prefill from the budget rule;
- :class:`PrebuiltSource` (the batch path: documents prefilled together, a sweep's settings built from
  one prefill): one-row caches split off caches that already exist; they all join at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv.allocation import row_budgets
from ..kv.compress import Compressor
from ..kv.storage.cache import VarLenCache
from ..kv.storage.rows import take_rows
from ..kv.storage.store import BLOCK, VarLenLayer, segment_bytes
from .batching import Row
from .decoding import RoundResult
from .memory import now
from .runner import ModelRunner

# kept entries, kept bytes, context prefill + compression seconds, compression seconds
Cost = tuple[int, int, float, float]


@dataclass
class Opened:
    """A row's compressed context, ready for its first question."""

    cache: VarLenCache  # one row
    ctx_len: int
    logits: torch.Tensor  # (V,) after the context
    cost: Cost


@dataclass
class Sequence:
    """One row in the batch: its context's cost and rollback marks, and its current answer."""

    index: int  # its row's place among the call's rows
    row: Row
    ctx_len: int
    context: list[torch.Tensor]  # per layer (H,) segment lengths of the compressed context
    cost: Cost
    limit: int
    context_logits: torch.Tensor  # (V,) after the context (a query-aware row's question is in it)
    round: int = 0
    logits: torch.Tensor | None = None  # (V,) predicting the next token
    question_logits: torch.Tensor | None = None  # (V,) predicting the current answer's first token
    next_pos: int = 0
    question_tokens: int = 0
    question_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    row_steps: int = 0  # rows decoded beside it (itself included), summed over its steps
    footprint: int = 0  # bytes its rows of the cache hold (reserved for the whole answer)
    tokens: list[int] = field(default_factory=list)
    stop_id: int | None = None
    results: list[RoundResult] = field(default_factory=list)
    # under a decode-time cap (whose eviction reorders entries) marks are copies: the compressed context
    # for the next questions, and the row at its question's end for fidelity; None when not needed
    saved_context: list[VarLenLayer] | None = None
    asked: list[torch.Tensor] | list[VarLenLayer] | None = None  # per layer: lengths, or a copy (cap)

    @property
    def rounds(self) -> int:
        return len(self.row.question_indices)


class DocumentSource:
    """Each row prefilled and compressed alone with ``compressor`` when it is admitted."""

    together = False  # rows open one by one, as the KV memory admits them

    def __init__(self, runner: ModelRunner, compressor: Compressor) -> None:
        self.runner, self.compressor = runner, compressor

    def estimate(self, index: int, row: Row) -> int:
        """Bytes a document will need, before it is prefilled: per layer and KV head its kept entries
        (the budget rule), its first question and answer, and the rounding of a segment's room to
        whole blocks (:data:`~pipeline.kv.storage.store.BLOCK`), each segment's bytes by the store's own rule
        (:func:`~pipeline.kv.storage.store.segment_bytes`: under a decode-time cap every slot also holds its
        statistics). A document with several questions under a cap keeps a copy of its compressed
        context (:class:`Sequence` ``saved_context``)."""
        shape, cfg = self.runner.shape, self.compressor.config
        n = len(row.prompt.context_ids)
        kept = (
            int(row_budgets(torch.tensor([n]), cfg.cache_size, cfg.budget, cfg.window)[0][0]) if cfg.compresses else n
        )
        question = len(row.prompt.question_ids[0]) if row.prompt.question_ids else 0
        slots = kept + question + self.runner.max_new_tokens_for(row.request) + BLOCK - 1
        capped = cfg.max_cache_tokens is not None
        if capped and len(row.question_indices) > 1:
            slots += kept
        return shape.num_layers * shape.num_kv_heads * segment_bytes(slots, shape.head_dim, shape.itemsize, capped)

    def open(self, index: int, row: Row) -> Opened:
        """The document's own prefill and compression (phases as in any prefill)."""
        t0 = now(self.runner.device)
        one = self.runner.new_cache(self.compressor)
        ctx_len, logits = self.runner.prefill.run([row], one)
        context_s = now(self.runner.device) - t0
        cost = (int(one.context_entries[0]), int(one.context_bytes[0]), context_s, one.compress_seconds)
        return Opened(one, int(ctx_len[0]), logits[0], cost)


class PrebuiltSource:
    """Rows whose compressed contexts exist already: row ``index`` is ``opened[index]``, handed over
    (and no longer held here) when it is admitted."""

    together = True  # every row joins at once (its context exists already): questions prefilled together

    def __init__(self, opened: list[Opened]) -> None:
        self.opened: list[Opened | None] = list(opened)

    @classmethod
    def split(cls, cache: VarLenCache, ctx_len: torch.Tensor, logits: torch.Tensor, costs: list[Cost]) -> list[Opened]:
        """One-row caches of every row of ``cache`` (B rows), each with its context length, last
        logits (``logits``: (B, V)) and cost. ``cache`` is consumed: each layer is released once its
        rows are copied (a single row's layers are taken over, not copied), so the split holds at most
        one layer twice."""
        rows = cache.store[0].num_rows
        per_row: list[list] = [[] for _ in range(rows)]
        for idx, layer in enumerate(cache.store):
            cache.store[idx] = None
            for b in range(rows):
                per_row[b].append(layer if rows == 1 else take_rows(layer, [b]))
            del layer
        opened = []
        for b, layers in enumerate(per_row):
            one = VarLenCache.from_layers(layers, cache.compressor, cache.kernels)
            opened.append(Opened(one, int(ctx_len[b]), logits[b], costs[b]))
        return opened

    def open(self, index: int, row: Row) -> Opened:
        opened, self.opened[index] = self.opened[index], None
        return opened
