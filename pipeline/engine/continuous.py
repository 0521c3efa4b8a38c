"""A continuous decode batch: the documents of one call decoded together within a KV memory budget,
rows leaving as their answers end and waiting documents joining as memory frees.

Compression frees memory; decoding more documents at once is what turns it into throughput (a decode
step reads the weights once whatever the batch). Per call of :meth:`Engine.generate` with
``kv_memory`` set (:class:`~pipeline.engine.config.GenerationConfig`):

1. documents wait in input order. The next one is prefilled and compressed **alone** (its own
   one-row cache, the method's phases as in any prefill), its first question prefilled and room
   reserved for its answer: its footprint is then exact (its cache's bytes);
2. it joins the decode batch while the footprints of the rows there plus its own fit ``kv_memory``.
   A document larger than the whole budget decodes alone (a warning says so). At most one prefilled
   document waits for room, so memory stays within the budget + one document's prefill + the model;
3. one greedy step decodes every row of the batch. A row whose answer ends (EOS or its limit) leaves
   at once: with another question its context is rolled back, the question prefilled alone and the
   row joins again; otherwise its answers are done. Leaving and joining rebuild the batch's cache
   layer by layer (:mod:`pipeline.kv.rows`).

Greedy answers are those of each document answered alone (tested for every method family).
Times of an answer: ``ttft_s`` = the document's own prefill and compression + its question's prefill;
``decode_s`` = the wall time of the decode steps its row took part in, which it shares with the rows
decoded beside it (the batch's throughput, not a per-row latency); ``peak_memory_bytes`` = the call's.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from ..kv.allocation import row_budgets
from ..kv.cache import VarLenCache
from ..kv.compress import Compressor
from ..kv.rows import layer_lengths, regroup, take_rows
from ..kv.store import BLOCK
from .answers import ContextCost, make_answers
from .batching import Row
from .decoding import RoundResult
from .memory import PeakMemory, now
from .types import Answer

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    """One document in the batch: its context's cost and rollback mark, and its current answer."""

    index: int  # its row's place among the call's rows
    row: Row
    ctx_len: int
    context: list[torch.Tensor]  # per layer (H,) segment lengths of the compressed context
    cost: tuple[int, int, float, float]  # kept entries, kept bytes, prefill + compression s, compression s
    limit: int
    context_logits: torch.Tensor  # (V,) after the context (a query-aware row's question is in it)
    round: int = 0
    logits: torch.Tensor | None = None  # (V,) predicting the next token
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

    @property
    def rounds(self) -> int:
        return len(self.row.question_indices)


class ContinuousBatch:
    """One call's rows through a continuous decode batch (see the module docstring)."""

    def __init__(self, engine, compressor: Compressor, budget_bytes: int) -> None:
        self.engine, self.compressor, self.budget = engine, compressor, int(budget_bytes)
        self.decoder = engine.decoder
        self.done: dict[int, Sequence] = {}
        self.failed: dict[int, Exception] = {}
        self.largest_batch = 0  # rows decoded together at most (diagnostics, tests)
        self.largest_bytes = 0  # the batch's cache at most, in bytes
        self.steps = self.row_steps = 0  # decode steps, and rows decoded summed over them (occupancy)

    @torch.inference_mode()
    def run(self, rows: list[Row]) -> list[list[Answer] | Exception]:
        """Per row: its answers (question order), or the exception that stopped it."""
        meter = PeakMemory(self.engine.device)
        with meter:
            try:
                self._loop(rows)
            except Exception as exc:  # a shared step failed: every unfinished row is reported failed
                logger.warning("continuous decode batch failed (%s); its unfinished rows are retried alone", exc)
                for i in range(len(rows)):
                    if i not in self.done:
                        self.failed.setdefault(i, exc)
        out: list[list[Answer] | Exception] = []
        for i, row in enumerate(rows):
            if i in self.failed:
                out.append(self.failed[i])
                continue
            seq = self.done[i]
            entries, kept_bytes, context_s, compress_s = seq.cost
            cost = ContextCost([entries], [kept_bytes], context_s, compress_s, meter.peak_bytes)
            per_round = [[result] for result in seq.results]
            out.append(make_answers([row], [seq.ctx_len], per_round, cost, self.engine.shape))
        return out

    def _loop(self, rows: list[Row]) -> None:
        waiting: deque[int] = deque(range(len(rows)))
        cache = self.engine.new_cache(self.compressor)
        active: list[Sequence] = []
        joining: list[tuple[Sequence, VarLenCache]] = []
        ready: list[tuple[Sequence, VarLenCache]] = []  # prefilled, waiting for room (one at most)
        while waiting or ready or active or joining:
            self._admit(rows, waiting, ready, active, joining)
            if joining:
                regroup(cache, list(range(len(active))), [one for _, one in joining])
                active += [seq for seq, _ in joining]
                joining = []
            if active:
                self.largest_batch = max(self.largest_batch, len(active))
                self.largest_bytes = max(self.largest_bytes, cache.nbytes())
            ended = self._choose(active)
            if ended:
                sizes = cache.bytes_per_row().tolist(), cache.used_bytes_per_row().tolist()
                joining = [self._next_round(cache, j, active[j]) for j in ended if self._finish(sizes, j, active[j])]
                keep = [j for j in range(len(active)) if j not in set(ended)]
                active = [active[j] for j in keep]
                if keep:
                    regroup(cache, keep, [])
                else:
                    cache = self.engine.new_cache(self.compressor)
            if active:
                self._step(cache, active)

    def _admit(self, rows, waiting: deque, ready: list, active: list, joining: list) -> None:
        """Prefill waiting documents and let them join while their footprints fit the budget."""
        used = sum(seq.footprint for seq in active) + sum(seq.footprint for seq, _ in joining)
        while waiting or ready:
            if not ready:
                index = waiting[0]
                if (active or joining) and used + self._estimate(rows[index]) > self.budget:
                    return
                waiting.popleft()
                try:
                    ready.append(self._open(index, rows[index]))
                except Exception as exc:  # this document alone fails
                    self.engine._release_memory()
                    self.failed[index] = exc
                    continue
            seq, one = ready[0]
            if active or joining:
                if used + seq.footprint > self.budget:
                    return
            elif seq.footprint > self.budget:
                logger.warning(
                    "doc %r needs %.1f MiB of KV cache, more than kv_memory (%.1f MiB): it decodes alone",
                    seq.row.request.doc_id,
                    seq.footprint / 2**20,
                    self.budget / 2**20,
                )
            joining.append(ready.pop())
            used += seq.footprint

    def _estimate(self, row: Row) -> int:
        """Bytes a document will need, before it is prefilled: per layer and KV head its kept entries
        (the budget rule), its first question and answer, and the rounding of a segment's room to
        whole blocks (:data:`~pipeline.kv.store.BLOCK`), plus the segment tables."""
        shape, cfg = self.engine.shape, self.compressor.config
        n = len(row.prompt.context_ids)
        kept = (
            int(row_budgets(torch.tensor([n]), cfg.cache_size, cfg.budget, cfg.window)[0][0]) if cfg.compresses else n
        )
        question = len(row.prompt.question_ids[0]) if row.prompt.question_ids else 0
        slots = kept + question + self.engine.max_new_tokens_for(row.request) + BLOCK - 1
        segments = shape.num_layers * shape.num_kv_heads
        return segments * (slots * (2 * shape.head_dim * shape.itemsize + 4) + 3 * 8)

    def _open(self, index: int, row: Row) -> tuple[Sequence, VarLenCache]:
        """The document's own prefill and compression, then its first question."""
        t0 = now(self.engine.device)
        one = self.engine.new_cache(self.compressor)
        ctx_len, logits = self.engine.prefill([row], one)
        context_s = now(self.engine.device) - t0
        cost = (int(one.context_entries[0]), int(one.context_bytes[0]), context_s, one.compress_seconds)
        limit = self.engine.max_new_tokens_for(row.request)
        seq = Sequence(index, row, int(ctx_len[0]), layer_lengths(one), cost, limit, logits[0])
        self._ask(seq, one)
        return seq, one

    def _ask(self, seq: Sequence, one: VarLenCache) -> None:
        """Prefill question ``seq.round`` into the row's own cache, room reserved for its answer."""
        questions = seq.row.prompt.question_ids
        q_ids = questions[min(seq.round, len(questions) - 1)]
        t0 = now(self.engine.device)
        one.reserve(len(q_ids) + seq.limit)
        logits = seq.context_logits
        if q_ids:
            ids = torch.tensor([q_ids], dtype=torch.long, device=self.engine.device)
            pos = (seq.ctx_len + torch.arange(len(q_ids), device=self.engine.device))[None]
            logits = self.decoder.forward(one, ids, pos)[0]
        seq.question_s = now(self.engine.device) - t0
        seq.logits, seq.next_pos, seq.question_tokens = logits, seq.ctx_len + len(q_ids), len(q_ids)
        seq.tokens, seq.stop_id, seq.decode_s, seq.steps, seq.row_steps = [], None, 0.0, 0, 0
        seq.footprint = int(one.bytes_per_row()[0])

    def _choose(self, active: list[Sequence]) -> list[int]:
        """Each row's greedy token; returns the indices of rows whose answer ended."""
        if not active:
            return []
        choice = torch.stack([seq.logits for seq in active]).argmax(-1).tolist()
        ended = []
        for j, (seq, token) in enumerate(zip(active, choice)):
            if token in self.decoder.eos_ids:
                seq.stop_id = token
                ended.append(j)
                continue
            seq.tokens.append(token)
            if len(seq.tokens) >= seq.limit:
                ended.append(j)
        return ended

    def _finish(self, sizes: tuple[list[int], list[int]], j: int, seq: Sequence) -> bool:
        """Record row ``j``'s answer (``sizes``: the batch's reserved and used bytes per row); True
        when the document has another question."""
        reserved, used = sizes[0][j], sizes[1][j]
        text, finish_reason = self.decoder._text(seq.tokens, seq.stop_id)
        seq.results.append(
            RoundResult(
                text=text,
                finish_reason=finish_reason,
                decode_batch=seq.row_steps / seq.steps if seq.steps else None,
                generated_tokens=len(seq.tokens) + (1 if len(seq.tokens) < seq.limit else 0),
                question_tokens=seq.question_tokens,
                question_s=seq.question_s,
                decode_s=seq.decode_s,
                steps=seq.steps,
                token_ids=list(seq.tokens),
                stop_id=seq.stop_id,
                kv_bytes_reserved=int(reserved),
                kv_bytes_used=int(used),
            )
        )
        seq.round += 1
        if seq.round < seq.rounds:
            return True
        self.done[seq.index] = seq
        return False

    def _next_round(self, cache: VarLenCache, j: int, seq: Sequence) -> tuple[Sequence, VarLenCache]:
        """Row ``j`` rolled back to its context in a cache of its own, its next question prefilled."""
        layers = [take_rows(layer, [j], mark) for layer, mark in zip(cache.store, seq.context)]
        one = VarLenCache.from_layers(layers, self.compressor, self.engine.kernels)
        self._ask(seq, one)
        return seq, one

    def _step(self, cache: VarLenCache, active: list[Sequence]) -> None:
        """One greedy decode step of every row (each row's last chosen token)."""
        device = self.engine.device
        ids = torch.tensor([[seq.tokens[-1]] for seq in active], dtype=torch.long, device=device)
        pos = torch.tensor([[seq.next_pos] for seq in active], dtype=torch.long, device=device)
        t0 = now(device)
        logits = self.decoder.forward(cache, ids, pos)
        seconds = now(device) - t0
        self.steps, self.row_steps = self.steps + 1, self.row_steps + len(active)
        for j, seq in enumerate(active):
            seq.logits, seq.next_pos = logits[j], seq.next_pos + 1
            seq.decode_s += seconds
            seq.steps, seq.row_steps = seq.steps + 1, seq.row_steps + len(active)
