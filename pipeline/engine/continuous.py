"""The one decode loop: rows decoded together within a KV memory budget, each leaving as its answer
ends and waiting rows joining as memory frees.

Compression frees memory; decoding more documents at once is what turns it into throughput (a decode
step reads the weights once whatever the batch). Every decode goes through this loop: the jobs'
continuous batch (documents prefilled one by one, :class:`~pipeline.engine.sequences.DocumentSource`)
and the batch path (documents prefilled together, a sweep's settings built from one prefill:
:class:`~pipeline.engine.sequences.PrebuiltSource`, :mod:`pipeline.engine.sweep`).

1. rows wait in input order. The next one gets its compressed context from its source (its own
   one-row cache), its first question prefilled and room reserved for its answer: its footprint is
   then exact (its cache's bytes);
2. it joins the decode batch while the footprints of the rows there plus its own fit the budget.
   A row larger than the whole budget decodes alone (a warning says so). At most one opened row
   waits for room, so memory stays within the budget + one document's prefill + the model;
3. one greedy step decodes every row of the batch. A row whose answer ends (EOS or its limit) leaves
   at once: with another question its context is rolled back, the question prefilled alone and the
   row joins again; otherwise its answers are done. Leaving and joining rebuild the batch's cache
   layer by layer (:mod:`pipeline.kv.rows`). With fidelity on (sweeps), a row's answer NLL is measured
   as it leaves: the reference answer teacher-forced on a copy of its rows at the question's end.

Under a decode-time cap (its eviction reorders entries) the marks a row rolls back to are copies of
its rows (the compressed context when it has more questions; at the question's end for fidelity).
Greedy answers are those of each document answered alone (tested for every method family).
Times of an answer: ``ttft_s`` = the row's own prefill and compression + its question's prefill;
``decode_s`` = the wall time of the decode steps its row took part in, which it shares with the rows
decoded beside it (the batch's throughput, not a per-row latency); ``peak_memory_bytes`` = the call's.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import torch

from ..kv.cache import VarLenCache
from ..kv.compress import Compressor
from ..kv.rows import layer_lengths, regroup, take_rows
from ..kv.store import VarLenLayer
from .answers import ContextCost, make_answers
from .batching import Row, left_pad
from .decoding import RoundResult
from .fidelity import continuation_nll
from .memory import PeakMemory, now
from .sequences import DocumentSource, Opened, Sequence
from .types import Answer

logger = logging.getLogger(__name__)

# answers whose fidelity is measured together at most (their rows are held as copies until then)
FIDELITY_ROWS = 32
References = dict[int, list[list[int]]]  # row index -> per question round, the reference answer's tokens


class ContinuousBatch:
    """Rows through the decode loop (see the module docstring). ``source`` gives each row its
    compressed context (default: its own prefill with ``compressor``); ``compressor`` also decides
    the batch cache's decode-time behaviour (its cap). ``fidelity``: measure each answer's NLL of
    ``references`` (row index -> [round] tokens), or with ``references=None`` of its own answer."""

    def __init__(
        self,
        engine,
        compressor: Compressor,
        budget_bytes: float,
        source=None,
        fidelity: bool = False,
        references: References | None = None,
        on_done: Callable[[int, list[Answer]], None] | None = None,
    ) -> None:
        self.engine, self.compressor, self.budget = engine, compressor, budget_bytes
        self.on_done = None if fidelity else on_done  # fidelity holds answers until measured together
        self.meter: PeakMemory | None = None
        self.source = source or DocumentSource(engine, compressor)
        self.fidelity, self.references = fidelity, references
        self.decoder = engine.decoder
        self.capped = compressor.config.max_cache_tokens is not None
        self.done: dict[int, Sequence] = {}
        self.failed: dict[int, Exception] = {}
        self.largest_batch = 0  # rows decoded together at most (diagnostics, tests)
        self.largest_bytes = 0  # the batch's cache at most, in bytes
        self.steps = self.row_steps = 0  # decode steps, and rows decoded summed over them (occupancy)
        self.held: list[tuple] = []  # answers waiting for their fidelity (:meth:`_hold_for_fidelity`)

    @torch.inference_mode()
    def run(self, rows: list[Row]) -> list[list[Answer] | Exception]:
        """Per row: its answers (question order), or the exception that stopped it. ``on_done(i,
        answers)`` (when given) hears each answered row's answers as it leaves the loop, its peak
        memory the call's so far."""
        self.meter = meter = PeakMemory(self.engine.device)
        with meter:
            self.decode(rows)
        return [
            self.failed[i] if i in self.failed else self._answers(self.done[i], meter.peak_bytes)
            for i in range(len(rows))
        ]

    def _answers(self, seq: Sequence, peak_bytes: int | None) -> list[Answer]:
        entries, kept_bytes, context_s, compress_s = seq.cost
        cost = ContextCost([entries], [kept_bytes], context_s, compress_s, peak_bytes)
        per_round = [[result] for result in seq.results]
        return make_answers([seq.row], [seq.ctx_len], per_round, cost, self.engine.shape)

    @torch.inference_mode()
    def decode(self, rows: list[Row]) -> None:
        """Decode every row: ``done`` maps each answered row's index to its :class:`Sequence`,
        ``failed`` each other one's to the exception that stopped it."""
        try:
            self._loop(rows)
        except Exception as exc:  # a shared step failed: every unfinished row is reported failed
            logger.warning("continuous decode batch failed (%s); its unfinished rows are retried alone", exc)
            for i in range(len(rows)):
                if i not in self.done:
                    self.failed.setdefault(i, exc)

    def _loop(self, rows: list[Row]) -> None:
        waiting: deque[int] = deque(range(len(rows)))
        cache = self.engine.new_cache(self.compressor, compressed=True)
        active: list[Sequence] = []
        joining: list[tuple[list[Sequence], VarLenCache]] = []  # rows and the cache that holds them
        ready: list[tuple[Sequence, VarLenCache]] = []  # opened, waiting for room (one at most)
        while waiting or ready or active or joining:
            if self.source.together:
                joining += self._open_together(rows, waiting)
            else:
                self._admit(rows, waiting, ready, active, joining)
            if joining:
                regroup(cache, list(range(len(active))), [one for _, one in joining])
                active += [seq for seqs, _ in joining for seq in seqs]
                joining = []
            if active:
                self.largest_batch = max(self.largest_batch, len(active))
                self.largest_bytes = max(self.largest_bytes, cache.nbytes())
            ended = self._choose(active)
            if ended:
                joining = self._leave(cache, active, ended)
                keep = [j for j in range(len(active)) if j not in set(ended)]
                active = [active[j] for j in keep]
                if keep:
                    regroup(cache, keep, [])
                else:
                    cache = self.engine.new_cache(self.compressor, compressed=True)
            if active:
                self._step(cache, active)
        self._measure_fidelity()

    def _leave(self, cache: VarLenCache, active: list[Sequence], ended: list[int]) -> list:
        """Record the answers of rows ``ended`` (their fidelity too); returns those with another
        question, each rolled back in a cache of its own with that question prefilled."""
        sizes = cache.bytes_per_row().tolist(), cache.used_bytes_per_row().tolist()
        for j in ended:
            self._finish(sizes, j, active[j])
            if self.fidelity:
                self._hold_for_fidelity(cache, j, active[j])
        again = []
        for j in ended:
            seq = active[j]
            if seq.round < seq.rounds:
                again.append(([seq], self._next_round(cache, j, seq)))
            else:
                self.done[seq.index] = seq
                if self.on_done is not None:
                    self.on_done(seq.index, self._answers(seq, self.meter.so_far()))
        return again

    def _admit(self, rows, waiting: deque, ready: list, active: list, joining: list) -> None:
        """Open waiting rows and let them join while their footprints fit the budget."""
        used = sum(seq.footprint for seq in active) + sum(seq.footprint for seqs, _ in joining for seq in seqs)
        while waiting or ready:
            if not ready:
                index = waiting[0]
                if (active or joining) and used + self.source.estimate(index, rows[index]) > self.budget:
                    return
                waiting.popleft()
                try:
                    ready.append(self._open(index, rows[index]))
                except Exception as exc:  # this row alone fails
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
            seq, one = ready.pop()
            joining.append(([seq], one))
            used += seq.footprint

    def _open(self, index: int, row: Row) -> tuple[Sequence, VarLenCache]:
        """The row's compressed context from its source, then its first question."""
        seq, one = self._start(index, row)
        self._ask(seq, one)
        return seq, one

    def _start(self, index: int, row: Row) -> tuple[Sequence, VarLenCache]:
        """The row's compressed context from its source (its first question not asked yet)."""
        opened: Opened = self.source.open(index, row)
        one = opened.cache
        limit = self.engine.max_new_tokens_for(row.request)
        seq = Sequence(index, row, opened.ctx_len, layer_lengths(one), opened.cost, limit, opened.logits)
        if self.capped and seq.rounds > 1:
            seq.saved_context = [layer.clone() for layer in one.store]
        return seq, one

    def _open_together(self, rows: list[Row], waiting: deque) -> list[tuple[list[Sequence], VarLenCache]]:
        """Every waiting row of a source whose contexts exist already, their first questions prefilled
        together (one left-padded chunk, as a batch of documents prefilled together would)."""
        if not waiting:
            return []
        started = [self._start(index, rows[index]) for index in waiting]
        waiting.clear()
        seqs = [seq for seq, _ in started]
        together = self.engine.new_cache(self.compressor, compressed=True)
        regroup(together, [], [one for _, one in started])
        questions = [s.row.prompt.question_ids[0] if s.row.prompt.question_ids else [] for s in seqs]
        width = max(len(q) for q in questions)
        t0 = now(self.engine.device)
        together.reserve(width + max(s.limit for s in seqs))
        logits = torch.stack([s.context_logits for s in seqs])
        if width:
            start = torch.tensor([s.ctx_len for s in seqs])
            logits = torch.where(
                torch.tensor([bool(q) for q in questions], device=logits.device)[:, None],
                self.decoder.forward(together, *left_pad(questions, start, self.decoder.pad_id, self.engine.device)),
                logits,
            )
        seconds = now(self.engine.device) - t0
        marks = layer_lengths(together)
        heads, footprints = self.engine.shape.num_kv_heads, together.bytes_per_row().tolist()
        for k, (seq, q_ids) in enumerate(zip(seqs, questions)):
            self._asked(seq, logits[k], len(q_ids), seconds, footprints[k])
            if self.fidelity and self.capped:  # the row at its question's end: a copy under a cap ...
                seq.asked = [take_rows(layer, [k]) for layer in together.store]
            elif self.fidelity:  # ... else its segment lengths
                seq.asked = [m[k * heads : (k + 1) * heads] for m in marks]
        return [(seqs, together)]

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
        self._asked(seq, logits, len(q_ids), now(self.engine.device) - t0, int(one.bytes_per_row()[0]))
        if self.fidelity:
            seq.asked = [layer.clone() for layer in one.store] if self.capped else layer_lengths(one)

    def _asked(self, seq: Sequence, logits: torch.Tensor, question_tokens: int, seconds: float, row_bytes: int) -> None:
        """Start the row's answer after its question (``logits``: (V,) predicting its first token;
        ``row_bytes``: its rows of the cache); its footprint counts a saved context copy too."""
        seq.question_s = seconds
        seq.footprint = row_bytes + sum(layer.nbytes() for layer in seq.saved_context or [])
        seq.logits, seq.question_logits = logits, logits
        seq.next_pos, seq.question_tokens = seq.ctx_len + question_tokens, question_tokens
        seq.tokens, seq.stop_id, seq.decode_s, seq.steps, seq.row_steps = [], None, 0.0, 0, 0

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

    def _finish(self, sizes: tuple[list[int], list[int]], j: int, seq: Sequence) -> None:
        """Record row ``j``'s answer (``sizes``: the batch's reserved and used bytes per row)."""
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
                kv_bytes_reserved=int(sizes[0][j]),
                kv_bytes_used=int(sizes[1][j]),
            )
        )
        seq.round += 1

    def _hold_for_fidelity(self, cache: VarLenCache, j: int, seq: Sequence) -> None:
        """Keep a copy of row ``j`` at its question's end, with the answer just recorded, until its
        fidelity is measured (with other rows', :meth:`_measure_fidelity`)."""
        if self.capped:
            layers = seq.asked
        else:
            layers = [take_rows(layer, [j], mark) for layer, mark in zip(cache.store, seq.asked)]
        target = seq.results[-1].reference_tokens
        if self.references is not None:
            target = self.references[seq.index][seq.round - 1]
        self.held.append((seq.results[-1], layers, target, seq.question_logits, seq.ctx_len + seq.question_tokens))
        if len(self.held) >= FIDELITY_ROWS:
            self._measure_fidelity()

    def _measure_fidelity(self) -> None:
        """Each held answer's ``answer_nll``: its target teacher-forced after its question, on the held
        rows together (:func:`~pipeline.engine.fidelity.continuation_nll`)."""
        if not self.held:
            return
        results, rows, targets, first, start = zip(*self.held)
        self.held = []
        layers = [VarLenLayer.concat([row[idx] for row in rows]) for idx in range(len(rows[0]))]
        probe = VarLenCache.from_layers(layers, self.compressor, self.engine.kernels)
        start = torch.tensor(start, device=self.engine.device)
        nll = continuation_nll(self.engine.model, probe, torch.stack(first), list(targets), start, self.decoder.pad_id)
        for result, value in zip(results, nll):
            result.answer_nll = value

    def _next_round(self, cache: VarLenCache, j: int, seq: Sequence) -> VarLenCache:
        """Row ``j`` rolled back to its context in a cache of its own (returned), its next question prefilled."""
        if seq.saved_context is not None:  # a cap's eviction may have reordered the context: its copy
            if seq.round == seq.rounds - 1:  # its last question: the copy itself
                layers, seq.saved_context = seq.saved_context, None
            else:
                layers = [layer.clone() for layer in seq.saved_context]
        else:
            layers = [take_rows(layer, [j], mark) for layer, mark in zip(cache.store, seq.context)]
        one = VarLenCache.from_layers(layers, self.compressor, self.engine.kernels)
        self._ask(seq, one)
        return one

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
