"""Admission to the decode loop (:mod:`.continuous`): each waiting row gets its compressed context
from its source (its own one-row cache), its first question prefilled and room reserved for its answer,
and joins the decode batch while the footprints of the rows there plus its own fit the KV memory (``kv_memory``).

Before a row is opened its bytes are estimated by its source (a document source: from its kept entries
and the store's own footprint rule, :func:`~pipeline.kv.storage.store.segment_bytes`); once its question is
asked its footprint is exact (its cache's bytes). A row larger than the whole KV memory decodes alone (a
warning says so). At most one opened row waits for room, so memory stays within the KV memory + one
document's prefill + the model. While rows decode, the next waiting row is opened only after they
have decoded for ``decode_between_prefills`` times the last opening's seconds, so that the first
documents of a call finish (and are committed) while later ones are still to be prefilled, at the cost
of decode steps with fewer rows (0: open every row that fits first). A source whose contexts exist
already (``together``: a batch of documents prefilled together, a sweep's settings) has every row join
at once, first questions prefilled together.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from ..kv.compress import Compressor
from ..kv.storage.cache import VarLenCache
from ..kv.storage.rows import layer_lengths, regroup, take_rows
from .batching import Row, left_pad
from .memory import now
from .runner import ModelRunner
from .sequences import Opened, Sequence

logger = logging.getLogger(__name__)


class Admission:
    """Opens and admits rows for one decode loop (see the module docstring). ``fidelity``: each row
    keeps its mark at its question's end; ``failed``: where a row that cannot be opened is recorded."""

    def __init__(
        self, runner: ModelRunner, source, compressor: Compressor, memory: float, fidelity: bool, failed: dict
    ) -> None:
        self.runner, self.source, self.compressor, self.memory = runner, source, compressor, memory
        self.fidelity, self.failed = fidelity, failed
        self.capped = compressor.config.max_cache_tokens is not None
        self.last_open = (0.0, 0.0)  # (seconds, end time) of the last row opened

    def paced(self, decoding: bool) -> bool:
        """Whether the next waiting row must wait for the decoding rows (``decode_between_prefills``):
        since the last row was opened they have decoded for less than that many times its opening."""
        pause = self.runner.generation.decode_between_prefills
        if not decoding or not pause:
            return False
        seconds, ended = self.last_open
        return now(self.runner.device) - ended < pause * seconds

    def admit(self, rows, waiting: deque, ready: list, active: list, joining: list) -> None:
        """Open waiting rows and let them join while their footprints fit the KV memory."""
        used = sum(seq.footprint for seq in active) + sum(seq.footprint for seqs, _ in joining for seq in seqs)
        while waiting or ready:
            if not ready:
                index = waiting[0]
                if self.paced(bool(active or joining)):
                    return
                if (active or joining) and used + self.source.estimate(index, rows[index]) > self.memory:
                    return
                waiting.popleft()
                started = now(self.runner.device)
                try:
                    ready.append(self._open(index, rows[index]))
                except Exception as exc:  # this row alone fails
                    self.runner.release_memory()
                    self.failed[index] = exc
                    continue
                finally:
                    ended = now(self.runner.device)
                    self.last_open = (ended - started, ended)
            seq, one = ready[0]
            if active or joining:
                if used + seq.footprint > self.memory:
                    return
            elif seq.footprint > self.memory:
                logger.warning(
                    "doc %r needs %.1f MiB of KV cache, more than kv_memory (%.1f MiB): it decodes alone",
                    seq.row.request.doc_id,
                    seq.footprint / 2**20,
                    self.memory / 2**20,
                )
            seq, one = ready.pop()
            joining.append(([seq], one))
            used += seq.footprint

    def _open(self, index: int, row: Row) -> tuple[Sequence, VarLenCache]:
        """The row's compressed context from its source, then its first question."""
        seq, one = self._start(index, row)
        self.ask(seq, one)
        return seq, one

    def _start(self, index: int, row: Row) -> tuple[Sequence, VarLenCache]:
        """The row's compressed context from its source (its first question not asked yet)."""
        opened: Opened = self.source.open(index, row)
        one = opened.cache
        limit = self.runner.max_new_tokens_for(row.request)
        seq = Sequence(index, row, opened.ctx_len, layer_lengths(one), opened.cost, limit, opened.logits)
        if self.capped and seq.rounds > 1:
            seq.saved_context = [layer.clone() for layer in one.store]
        return seq, one

    def open_together(self, rows: list[Row], waiting: deque) -> list[tuple[list[Sequence], VarLenCache]]:
        """Every waiting row of a source whose contexts exist already, their first questions prefilled
        together (one left-padded chunk, as a batch of documents prefilled together would)."""
        if not waiting:
            return []
        started = [self._start(index, rows[index]) for index in waiting]
        waiting.clear()
        seqs = [seq for seq, _ in started]
        together = self.runner.new_cache(self.compressor, compressed=True)
        regroup(together, [], [one for _, one in started])
        questions = [s.row.prompt.question_ids[0] if s.row.prompt.question_ids else [] for s in seqs]
        width = max(len(q) for q in questions)
        t0 = now(self.runner.device)
        together.reserve(width + max(s.limit for s in seqs))
        logits = torch.stack([s.context_logits for s in seqs])
        if width:
            start = torch.tensor([s.ctx_len for s in seqs])
            logits = torch.where(
                torch.tensor([bool(q) for q in questions], device=logits.device)[:, None],
                self.runner.decoder.forward(
                    together, *left_pad(questions, start, self.runner.decoder.pad_id, self.runner.device)
                ),
                logits,
            )
        seconds = now(self.runner.device) - t0
        marks = layer_lengths(together)
        heads, footprints = self.runner.shape.num_kv_heads, together.bytes_per_row().tolist()
        for k, (seq, q_ids) in enumerate(zip(seqs, questions)):
            self._asked(seq, logits[k], len(q_ids), seconds, footprints[k])
            if self.fidelity and self.capped:  # the row at its question's end: a copy under a cap ...
                seq.asked = [take_rows(layer, [k]) for layer in together.store]
            elif self.fidelity:  # ... else its segment lengths
                seq.asked = [m[k * heads : (k + 1) * heads] for m in marks]
        return [(seqs, together)]

    def ask(self, seq: Sequence, one: VarLenCache) -> None:
        """Prefill question ``seq.round`` into the row's own cache, room reserved for its answer."""
        questions = seq.row.prompt.question_ids
        q_ids = questions[min(seq.round, len(questions) - 1)]
        t0 = now(self.runner.device)
        one.reserve(len(q_ids) + seq.limit)
        logits = seq.context_logits
        if q_ids:
            ids = torch.tensor([q_ids], dtype=torch.long, device=self.runner.device)
            pos = (seq.ctx_len + torch.arange(len(q_ids), device=self.runner.device))[None]
            logits = self.runner.decoder.forward(one, ids, pos)[0]
        self._asked(seq, logits, len(q_ids), now(self.runner.device) - t0, int(one.bytes_per_row()[0]))
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
