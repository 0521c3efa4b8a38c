"""Compression sweeps: every setting of a batch from one prefill, the compressed settings decoded
side by side.

Per batch of B documents (:meth:`pipeline.engine.engine.Engine.generate_sweep`):

1. one prefill into a :class:`~pipeline.kv.capture.CaptureCache` (every layer's dense K/V kept),
   then KVzip's reconstruction passes once per distinct (chunk, KVzip+) among the settings;
2. the full-cache setting (if swept) is answered first, alone: its answers are the references
   whose likelihood every setting's cache is measured on (answer fidelity);
3. the compressing settings, in groups of ``settings_per_decode`` (ordered by cache size and
   allocation so that uniform settings of one size share a rectangular layout): each setting's
   cache is built from the capture, the group's caches are stacked into one cache of g x B rows
   (:meth:`~pipeline.kv.cache.VarLenCache.stacked`) and decoded as one batch. On CPU a decode step
   is bound by reading the weights, so g rows cost little more than one.

A chunked setting (``prefill_chunk``) cannot use the shared prefill (its later chunks attend to its own
compressed cache): it runs its own prefill and joins a decode group with its own cache and last
logits; its ``ttft_s`` counts its own prefill. Each setting keeps its own kept entries and bytes and
its own ``compress_s``; the question and
decode times of a row are those of its group (``settings_per_decode=1`` gives per-setting times).
Peak memory covers the capture plus one group's caches.
"""

from __future__ import annotations

import torch

from ..kv.cache import VarLenCache
from ..kv.capture import CaptureCache
from ..kv.compress import Compressor
from ..kv.phases import Phase
from .answers import ContextCost, make_answers
from .batching import Row, warn_below_window
from .memory import PeakMemory, now
from .types import Answer, Setting


def decode_groups(compressors: list[Compressor], size: int) -> list[list[int]]:
    """Indices of ``compressors`` in decode groups: full-cache settings first, each alone; then the
    compressing ones by (cache size, allocation, budget), ``size`` per group; settings with a
    decode-time cap alone (their caches evict per row and cannot be stacked)."""
    full = [i for i, c in enumerate(compressors) if not c.config.compresses]
    alone = [i for i, c in enumerate(compressors) if c.config.compresses and _own_cache(c)]
    rest = [i for i, c in enumerate(compressors) if c.config.compresses and not _own_cache(c)]
    rest.sort(key=lambda i: _layout_key(compressors[i]))
    groups = [[i] for i in full + alone]
    groups += [rest[k : k + size] for k in range(0, len(rest), size)]
    return groups


def _own_cache(compressor: Compressor) -> bool:
    """Decoded alone: a decode-time cap evicts per row (a chunked setting is stacked like the others,
    with its own cache and last logits)."""
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
    """One batch of a sweep (see the module docstring); ``engine`` supplies the model's decoder,
    reconstruction passes, shape and limits."""

    def __init__(self, engine, rows: list[Row], compressors: list[Compressor]) -> None:
        self.engine, self.rows, self.compressors = engine, rows, compressors
        self.limits = [engine.max_new_tokens_for(row.request) for row in rows]
        self.reference = None
        self.results: dict[int, tuple] = {}

    def run(self) -> list[Answer]:
        engine, rows = self.engine, self.rows
        for compressor in self.compressors:
            if not compressor.config.chunked:  # a chunked setting's own prefill warns
                warn_below_window(rows, compressor.config)
        meter = PeakMemory(engine.device)
        with meter:
            capture = CaptureCache(engine.shape.num_layers, self.compressors, engine.kernels)
            t0 = now(engine.device)
            ctx_len, logits = engine.decoder.prefill(rows, capture)
            prefill_s = now(engine.device) - t0
            passes = self._reconstructions(capture)
            for group in decode_groups(self.compressors, engine.generation.settings_per_decode):
                self._decode_group(group, capture, passes, ctx_len, logits)
        answers = []
        for index, compressor in enumerate(self.compressors):
            entries, kept_bytes, compress_s, per_round, own_prefill = self.results[index]
            cfg = compressor.config
            context_s = own_prefill if own_prefill is not None else prefill_s + compress_s
            cost = ContextCost(entries, kept_bytes, context_s, compress_s, meter.peak_bytes)
            setting = Setting(cfg.label, cfg.cache_size, cfg.budget)
            answers += make_answers(rows, ctx_len.tolist(), per_round, cost, engine.shape, setting, self.reference)
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
            t0 = now(self.engine.device)
            scores = self.engine.reconstruction.scores(contexts, prefixes, capture.pending_layers(), *key)
            out[key] = (scores, now(self.engine.device) - t0)
        return out

    def _chunked_prefill(self, compressor: Compressor) -> tuple[VarLenCache, object, float]:
        """A chunked setting's cache, last logits and seconds from its own prefill (its ``ttft_s``
        counts that prefill instead of the shared one)."""
        t0 = now(self.engine.device)
        cache = self.engine.new_cache(compressor)
        _, logits = self.engine.prefill(self.rows, cache)
        return cache, logits, now(self.engine.device) - t0

    def _decode_group(self, group: list[int], capture: CaptureCache, passes: dict, ctx_len, logits) -> None:
        """Build the group's caches, stack them, answer every round; store each setting's share."""
        built, caches, first_logits = [], [], []
        for index in group:
            own_prefill, own_logits = None, logits
            if self.compressors[index].config.chunked:  # its own prefill: later chunks see the compressed cache
                cache, own_logits, own_prefill = self._chunked_prefill(self.compressors[index])
                seconds = cache.compress_seconds
            else:
                scores, pass_s = passes.get(reconstruction_key(self.compressors[index]), (None, 0.0))
                cache = capture.compressed(index, observed=scores)
                seconds = cache.compress_seconds + pass_s
            built.append((cache.context_entries.tolist(), cache.context_bytes.tolist(), seconds, own_prefill))
            caches.append(cache)
            first_logits.append(own_logits)
        cache = caches[0] if len(caches) == 1 else VarLenCache.stacked(caches)
        del caches  # the stacked copy is all that stays alive
        g, b = len(group), len(self.rows)
        decoder = self.engine.decoder
        refs = None if self.reference is None else [[x.reference_tokens for x in rnd] * g for rnd in self.reference]
        own = self.reference is None and not self.compressors[group[0]].config.compresses
        per_round = decoder.answer_rounds(
            cache, self.rows * g, ctx_len.repeat(g), torch.cat(first_logits), self.limits * g, refs, own_reference=own
        )
        if own:
            self.reference = per_round
        for j, index in enumerate(group):
            entries, kept_bytes, compress_s, own_prefill = built[j]
            share = [rnd[j * b : (j + 1) * b] for rnd in per_round]
            self.results[index] = (entries, kept_bytes, compress_s, share, own_prefill)
