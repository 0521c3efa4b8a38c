"""The one decode loop: rows decoded together within a KV memory (``kv_memory``), each leaving as its answer
ends and waiting rows joining as memory frees (admission: :mod:`.admission`; answer fidelity:
:class:`~.fidelity.FidelityMeter`).

Compression frees memory; decoding more documents at once is what turns it into throughput (a decode
step reads the weights once whatever the batch). Every decode goes through this loop: the jobs'
continuous batch (documents prefilled one by one, :class:`~pipeline.engine.sequences.DocumentSource`)
and the batch path (documents prefilled together, a sweep's settings built from one prefill:
:class:`~pipeline.engine.sequences.PrebuiltSource`, :mod:`pipeline.engine.sweep`).

1. rows wait in input order. The next one gets its compressed context from its source (its own
   one-row cache), its first question prefilled and room reserved for its answer: its footprint is
   then exact (its cache's bytes);
2. it joins the decode batch while the footprints of the rows there plus its own fit the KV memory.
   A row larger than the whole KV memory decodes alone (a warning says so). At most one opened row
   waits for room, so memory stays within the KV memory + one document's prefill + the model. While rows
   decode, the next document is prefilled only after they have decoded for ``decode_between_prefills``
   times the last prefill's seconds (the first answers end, and are committed, sooner);
3. one greedy step decodes every row of the batch. A row whose answer ends (EOS or its limit) leaves
   at once: with another question its context is rolled back, the question prefilled alone and the
   row joins again; otherwise its answers are done. Leaving and joining rebuild the batch's cache
   layer by layer (:mod:`pipeline.kv.storage.rows`). With fidelity on (sweeps), a row's answer NLL is measured
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

from ..kv.compress import Compressor
from ..kv.storage.cache import VarLenCache
from ..kv.storage.rows import regroup, take_rows
from .admission import Admission
from .answers import ContextCost, make_answers
from .batching import Row
from .decoding import RoundResult
from .fidelity import FidelityMeter, References
from .memory import PeakMemory, now
from .runner import ModelRunner
from .sequences import DocumentSource, Sequence
from .types import Answer

logger = logging.getLogger(__name__)


class ContinuousBatch:
    """Rows through the decode loop (see the module docstring). ``source`` gives each row its
    compressed context (default: its own prefill with ``compressor``); ``compressor`` also decides
    the batch cache's decode-time behaviour (its cap). ``fidelity``: measure each answer's NLL of
    ``references`` (row index -> [round] tokens), or with ``references=None`` of its own answer
    (:class:`~.fidelity.FidelityMeter`)."""

    def __init__(
        self,
        runner: ModelRunner,
        compressor: Compressor,
        memory_bytes: float,
        source=None,
        fidelity: bool = False,
        references: References | None = None,
        on_done: Callable[[int, list[Answer]], None] | None = None,
    ) -> None:
        self.runner, self.compressor = runner, compressor
        self.on_done = None if fidelity else on_done  # fidelity holds answers until measured together
        self.meter: PeakMemory | None = None
        self.source = source or DocumentSource(runner, compressor)
        self.fidelity = FidelityMeter(runner, compressor, references) if fidelity else None
        self.decoder = runner.decoder
        self.done: dict[int, Sequence] = {}
        self.failed: dict[int, Exception] = {}
        self.admission = Admission(runner, self.source, compressor, memory_bytes, fidelity, self.failed)
        self.largest_batch = 0  # rows decoded together at most (diagnostics, tests)
        self.largest_bytes = 0  # the batch's cache at most, in bytes
        self.steps = self.row_steps = 0  # decode steps, and rows decoded summed over them (occupancy)

    @torch.inference_mode()
    def run(self, rows: list[Row]) -> list[list[Answer] | Exception]:
        """Per row: its answers (question order), or the exception that stopped it. ``on_done(i,
        answers)`` (when given) hears each answered row's answers as it leaves the loop, its peak
        memory the call's so far."""
        self.meter = meter = PeakMemory(self.runner.device)
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
        return make_answers([seq.row], [seq.ctx_len], per_round, cost, self.runner.shape)

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
        cache = self.runner.new_cache(self.compressor, compressed=True)
        active: list[Sequence] = []
        joining: list[tuple[list[Sequence], VarLenCache]] = []  # rows and the cache that holds them
        ready: list[tuple[Sequence, VarLenCache]] = []  # opened, waiting for room (one at most)
        while waiting or ready or active or joining:
            if self.source.together:
                joining += self.admission.open_together(rows, waiting)
            else:
                self.admission.admit(rows, waiting, ready, active, joining)
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
                    cache = self.runner.new_cache(self.compressor, compressed=True)
            if active:
                self._step(cache, active)
        if self.fidelity is not None:
            self.fidelity.measure()

    def _leave(self, cache: VarLenCache, active: list[Sequence], ended: list[int]) -> list:
        """Record the answers of rows ``ended`` (their fidelity too); returns those with another
        question, each rolled back in a cache of its own with that question prefilled."""
        sizes = cache.bytes_per_row().tolist(), cache.used_bytes_per_row().tolist()
        for j in ended:
            self._finish(sizes, j, active[j])
            if self.fidelity is not None:
                self.fidelity.hold(cache, j, active[j])
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

    def _next_round(self, cache: VarLenCache, j: int, seq: Sequence) -> VarLenCache:
        """Row ``j`` rolled back to its context in a cache of its own (returned), its next question prefilled."""
        if seq.saved_context is not None:  # a cap's eviction may have reordered the context: its copy
            if seq.round == seq.rounds - 1:  # its last question: the copy itself
                layers, seq.saved_context = seq.saved_context, None
            else:
                layers = [layer.clone() for layer in seq.saved_context]
        else:
            layers = [take_rows(layer, [j], mark) for layer, mark in zip(cache.store, seq.context)]
        one = VarLenCache.from_layers(layers, self.compressor, self.runner.kernels)
        self.admission.ask(seq, one)
        return one

    def _step(self, cache: VarLenCache, active: list[Sequence]) -> None:
        """One greedy decode step of every row (each row's last chosen token)."""
        device = self.runner.device
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
