"""The batch path: every compression setting of a batch of documents from one prefill, the compressed
settings decoded side by side. A plain batch (one setting: a job with ``--no-continuous`` or a
decode-time cap, a document retried alone) is a sweep of one setting.

Per batch of B documents (:meth:`pipeline.engine.engine.Engine.generate_sweep`, and with one setting
:meth:`~pipeline.engine.engine.Engine.generate`'s batch path):

1. one prefill into a :class:`~pipeline.kv.prefill.capture.CaptureCache` (every layer's dense K/V kept),
   then KVzip's reconstruction passes once per distinct (chunk, KVzip+) among the settings;
2. the full-cache setting (if swept) is answered first, alone: its answers are the references
   whose likelihood every setting's cache is measured on (answer fidelity);
3. the compressing settings, in groups of ``settings_per_decode`` (ordered by cache size and
   allocation): each setting's cache is built from the capture and split into one-row caches, and
   the group's g x B rows are decoded together in the decode loop (:mod:`pipeline.engine.continuous`):
   their first questions prefilled together (one left-padded chunk), each row leaving the batch the
   step its answer ends. On CPU a decode step is bound by reading the weights, so g rows cost little
   more than one.

A setting runs its own prefill instead of the shared one when it is the batch's only setting (a
shared dense capture would only hold memory: its own prefill compresses each layer as the method's
phases allow) or chunked (``prefill_chunk``: its later chunks attend to its own compressed cache); it
joins a decode group with its own cache and last logits, and its ``ttft_s`` counts its own prefill.
Answer fidelity (step 2 and the likelihood of the references) is measured only in sweeps
(``fidelity``), as each row leaves. Each setting keeps its own kept entries and bytes and its own
``compress_s``; a row's question time is its group's first-question prefill (a later question's: its
own) and its decode time that of the steps it took part in (shared with the rows decoded beside it).
Peak memory covers the capture plus one group's caches.
"""

from __future__ import annotations

import torch

from ..kv.compress import Compressor
from ..kv.phases import Phase
from ..kv.prefill.capture import CaptureCache
from ..kv.prefill.rules import shares_capture
from ..kv.storage.cache import VarLenCache
from .answers import ContextCost, make_answers
from .batching import Row, warn_below_window
from .continuous import ContinuousBatch
from .memory import PeakMemory, now
from .runner import ModelRunner
from .sequences import PrebuiltSource
from .types import Answer, Setting


def decode_groups(compressors: list[Compressor], size: int) -> list[list[int]]:
    """Indices of ``compressors`` in decode groups: full-cache settings first, each alone; then the
    compressing ones by (cache size, allocation, budget), ``size`` per group; settings with a
    decode-time cap alone (the batch cache of a group applies one cap to all its rows)."""
    full = [i for i, c in enumerate(compressors) if not c.config.compresses]
    alone = [i for i, c in enumerate(compressors) if c.config.compresses and _own_cache(c)]
    rest = [i for i, c in enumerate(compressors) if c.config.compresses and not _own_cache(c)]
    rest.sort(key=lambda i: _layout_key(compressors[i]))
    groups = [[i] for i in full + alone]
    groups += [rest[k : k + size] for k in range(0, len(rest), size)]
    return groups


def _own_cache(compressor: Compressor) -> bool:
    """Decoded alone: a decode-time cap belongs to the decode loop's batch cache, which would apply it to
    every row of a group (a chunked setting joins a group like the others, with its own cache and last
    logits)."""
    return compressor.config.max_cache_tokens is not None


def _layout_key(compressor: Compressor) -> tuple:
    cfg = compressor.config
    return (cfg.cache_size, cfg.budget or 0, cfg.allocation, cfg.label)


def reconstruction_key(compressor: Compressor) -> tuple | None:
    """What a setting's reconstruction scores depend on (None: it needs none)."""
    if compressor.phase is not Phase.PASSES:
        return None
    return compressor.config.reconstruction_chunk, compressor.config.kvzip_plus


class SweepBatch:
    """One batch of a sweep (see the module docstring); ``runner`` supplies the model's decoder,
    prefill, reconstruction passes, shape and limits."""

    def __init__(
        self,
        runner: ModelRunner,
        rows: list[Row],
        compressors: list[Compressor],
        settings: list[Setting | None] | None = None,
        fidelity: bool = True,
    ) -> None:
        """``settings``: what each compressor's answers are labelled with (default: its method, cache
        size and budget); ``fidelity``: measure answer fidelity against the full cache (sweeps)."""
        self.runner, self.rows, self.compressors, self.fidelity = runner, rows, compressors, fidelity
        self.settings = settings or [Setting(c.config.label, c.config.cache_size, c.config.budget) for c in compressors]
        self.reference = None
        self.results: dict[int, tuple] = {}

    def own_prefill(self, index: int) -> bool:
        """Whether setting ``index`` runs its own prefill (see the module docstring)."""
        return len(self.compressors) == 1 or not shares_capture(self.compressors[index].config)

    def run(self) -> list[Answer]:
        runner, rows = self.runner, self.rows
        shared = [c for i, c in enumerate(self.compressors) if not self.own_prefill(i)]
        for compressor in shared:  # an own prefill warns itself
            warn_below_window(rows, compressor.config)
        ctx_len = torch.tensor([len(r.prompt.context_ids) for r in rows])
        meter = PeakMemory(runner.device)
        with meter:
            capture, logits, prefill_s, passes = None, None, 0.0, {}
            if shared:
                capture = CaptureCache(runner.shape.num_layers, self.compressors, runner.kernels)
                t0 = now(runner.device)
                _, logits = runner.prefill.run(rows, capture)
                prefill_s = now(runner.device) - t0
                passes = self._reconstructions(capture)
            for group in decode_groups(self.compressors, runner.generation.settings_per_decode):
                self._decode_group(group, capture, passes, ctx_len, logits)
        answers = []
        for index, setting in enumerate(self.settings):
            entries, kept_bytes, compress_s, per_round, own_prefill = self.results[index]
            context_s = own_prefill if own_prefill is not None else prefill_s + compress_s
            cost = ContextCost(entries, kept_bytes, context_s, compress_s, meter.peak_bytes)
            answers += make_answers(rows, ctx_len.tolist(), per_round, cost, runner.shape, setting, self.reference)
        return answers

    def _reconstructions(self, capture: CaptureCache) -> dict:
        """Reconstruction scores once per distinct (chunk, KVzip+) among the settings, with their seconds."""
        out = {}
        contexts = [r.prompt.context_ids for r in self.rows]
        prefixes = [r.prompt.prefix_tokens for r in self.rows]
        for compressor in self.compressors:
            key = reconstruction_key(compressor)
            if key is None or key in out:
                continue
            t0 = now(self.runner.device)
            scores = self.runner.reconstruction.scores(contexts, prefixes, capture.pending_layers(), *key)
            out[key] = (scores, now(self.runner.device) - t0)
        return out

    def _own_prefill(self, compressor: Compressor) -> tuple[VarLenCache, object, float]:
        """A setting's cache, last logits and seconds from its own prefill, compression included (its
        ``ttft_s`` counts that prefill instead of the shared one)."""
        t0 = now(self.runner.device)
        cache = self.runner.new_cache(compressor)
        _, logits = self.runner.prefill.run(self.rows, cache)
        return cache, logits, now(self.runner.device) - t0

    def _decode_group(self, group: list[int], capture: CaptureCache | None, passes: dict, ctx_len, logits) -> None:
        """Build the group's caches, split them into one-row caches and decode those together in the
        decode loop (:mod:`pipeline.engine.continuous`); store each setting's share."""
        built, opened = [], []
        for index in group:
            own_prefill, own_logits = None, logits
            if self.own_prefill(index):
                cache, own_logits, own_prefill = self._own_prefill(self.compressors[index])
                seconds = cache.compress_seconds
            else:
                scores, pass_s = passes.get(reconstruction_key(self.compressors[index]), (None, 0.0))
                cache = capture.compressed(index, observed=scores)
                seconds = cache.compress_seconds + pass_s
            entries, kept_bytes = cache.context_entries.tolist(), cache.context_bytes.tolist()
            built.append((entries, kept_bytes, seconds, own_prefill))
            costs = [(entries[b], kept_bytes[b], own_prefill or 0.0, seconds) for b in range(len(self.rows))]
            opened += PrebuiltSource.split(cache, ctx_len, own_logits, costs)
            del cache  # its rows live on in the one-row caches
        g, b = len(group), len(self.rows)
        own = self.fidelity and self.reference is None and not self.compressors[group[0]].config.compresses
        references = None
        if not own and self.fidelity and self.reference is not None:
            row_refs = [[rnd[k].reference_tokens for rnd in self.reference if rnd[k] is not None] for k in range(b)]
            references = {j * b + k: row_refs[k] for j in range(g) for k in range(b)}
        batch = ContinuousBatch(
            self.runner,
            self.compressors[group[0]],
            float("inf"),  # the group's caches exist already: every row joins at once
            PrebuiltSource(opened),
            fidelity=own or references is not None,
            references=references,
        )
        del opened
        batch.decode(self.rows * g)
        if batch.failed:  # the engine retries the documents one by one
            raise next(iter(batch.failed.values()))
        rounds = max(len(row.question_indices) for row in self.rows)
        per_round = [[_round(batch.done[k], r) for k in range(g * b)] for r in range(rounds)]
        if own:
            self.reference = per_round
        for j, index in enumerate(group):
            entries, kept_bytes, compress_s, own_prefill = built[j]
            share = [rnd[j * b : (j + 1) * b] for rnd in per_round]
            self.results[index] = (entries, kept_bytes, compress_s, share, own_prefill)


def _round(seq, r: int):
    """Round ``r``'s result of a decoded row (None: the row has fewer questions)."""
    return seq.results[r] if r < len(seq.results) else None
