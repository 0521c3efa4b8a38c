"""The context prefill of a batch of rows: the cache's plan (:func:`pipeline.kv.prefill.rules.plan_prefill`)
run over the model, phase by phase (:mod:`pipeline.kv.phases`).

* ``one-pass``: one forward of the left-padded contexts;
* ``layer-by-layer``: every decoder layer over the whole context in slices (:mod:`.layerwise`), for
  the model families that allow it (``layerwise_prefill`` on the model; others run one pass);
* ``chunks``: ``prefill_chunk`` tokens of every row at a time (positions [k*C, (k+1)*C)), the cache
  compressed after each chunk;

then, for a method that decides after KVzip's reconstruction passes, the passes (both in
``compress_s``) and the compression of every held layer. A sweep's capture cache
(:mod:`pipeline.kv.prefill.capture`) takes one forward.
"""

from __future__ import annotations

import torch

from .. import hooks
from ..kv.prefill.rules import PrefillPlan, plan_prefill
from ..kv.storage.cache import ChunkCache, VarLenCache
from .batching import Row, left_pad, warn_below_window
from .decoding import Decoder
from .layerwise import layerwise_prefill, usable_slice
from .memory import now
from .reconstruction import ContextReconstruction


class ContextPrefill:
    """Prefills contexts into caches for one model (see the module docstring)."""

    def __init__(self, decoder: Decoder, reconstruction: ContextReconstruction, layer_slice: int = 0) -> None:
        self.decoder, self.reconstruction = decoder, reconstruction
        self.layer_slice = usable_slice(decoder.model, layer_slice)  # tokens per slice of a layerwise prefill (0: off)

    def plan(self, cache: ChunkCache, context_length: int) -> PrefillPlan:
        """The plan ``cache`` runs over contexts of ``context_length`` columns (a capture: one pass)."""
        if not isinstance(cache, VarLenCache):
            return PrefillPlan()
        return plan_prefill(cache.compressor.config, self.layer_slice, context_length)

    def run(self, rows: list[Row], cache: ChunkCache, passes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The context prefill and compression of ``rows`` into the empty ``cache`` -> (context lengths
        (B,), last logits (B, V) float32). ``passes``: run KVzip's reconstruction passes where the
        method waits for them (False leaves the cache waiting: ``cache.prefill.awaiting_passes``)."""
        if isinstance(cache, VarLenCache):
            warn_below_window(rows, cache.compressor.config)
        hooks.fire("engine.prefill", doc_ids=[r.request.doc_id for r in rows], cache_size=cache.kept_fraction)
        contexts = [r.prompt.context_ids for r in rows]
        ctx_len = torch.tensor([len(c) for c in contexts])
        plan = self.plan(cache, int(ctx_len.max()))
        if plan.forward == "chunks":
            return ctx_len, self._chunks(contexts, ctx_len, cache, plan)
        starts = torch.zeros(len(rows), dtype=torch.long)
        ids, pos = left_pad(contexts, starts, self.decoder.pad_id, self.decoder.device)
        if plan.forward == "layer-by-layer":
            logits = layerwise_prefill(self.decoder.model, cache, ids, pos, plan)
        else:
            logits = self.decoder.forward(cache, ids, pos)
        if passes and isinstance(cache, VarLenCache) and cache.prefill is not None:
            self._passes(rows, cache)
        return ctx_len, logits

    def _chunks(self, contexts: list[list[int]], ctx_len: torch.Tensor, cache: VarLenCache, plan: PrefillPlan):
        """The chunked prefill (:mod:`pipeline.kv.prefill.chunk_eviction`); returns each row's last logits."""
        decoder, chunk, logits = self.decoder, plan.tokens, None
        strategy = cache.begin_prefill(plan, lengths=ctx_len.to(decoder.device))
        for begin in range(0, int(ctx_len.max()), chunk):
            pieces = [c[begin : begin + chunk] for c in contexts]
            ids, pos = left_pad(pieces, torch.full((len(contexts),), begin), decoder.pad_id, decoder.device)
            out = decoder.forward(cache, ids, pos)
            strategy.after_forward(ctx_len.clamp(max=begin + chunk).to(decoder.device))
            ends = ((ctx_len > begin) & (ctx_len <= begin + chunk)).to(out.device)
            logits = out if logits is None else torch.where(ends[:, None], out, logits)
        strategy.finish()
        return logits

    def _passes(self, rows: list[Row], cache: VarLenCache) -> None:
        """The ``PASSES`` phase: KVzip's reconstruction passes, then every held layer compressed (both in
        ``compress_s``)."""
        held = cache.prefill.awaiting_passes
        if held is None:
            return
        cfg = cache.compressor.config
        t0 = now(self.decoder.device)
        contexts, prefixes = [r.prompt.context_ids for r in rows], [r.prompt.prefix_tokens for r in rows]
        scores = self.reconstruction.scores(contexts, prefixes, held, cfg.reconstruction_chunk, cfg.kvzip_plus)
        cache.compress_seconds += now(self.decoder.device) - t0
        cache.prefill.finish(scores)
