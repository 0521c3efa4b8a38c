"""One prefill, many compressed caches: the capture cache behind compression sweeps.

Prefill attention does not depend on the method, so a sweep prefills each batch once into a
:class:`CaptureCache`, which keeps every layer's dense K/V and, per setting, what that setting's
scorer observes of the queries (:meth:`Compressor.observe`). :meth:`CaptureCache.compressed`
then builds the :class:`~pipeline.kv.storage.cache.VarLenCache` a setting would have built during that
prefill, handing each captured layer to the layer step of that cache's one-pass prefill
(:mod:`.layers`; the test suite checks the kept sets equal separate runs). A chunked setting cannot
be built from it (:func:`.rules.shares_capture`). Memory: the dense cache of
every layer is held until the sweep's batch ends (reported as the sweep's peak).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.dense import dense_prefill_attention
from ..attention.varlen_kernels import KernelChoice
from ..compress import Compressor, PendingLayer
from ..storage.cache import ChunkCache, VarLenCache


@dataclass
class CapturedLayer:
    """One layer's prefill: module, dense K/V (B, H_kv, n, D), positions (B, n), scaling, and
    ``observed[i]`` = what compressor i's scorer kept of the queries."""

    module: torch.nn.Module
    key: torch.Tensor
    value: torch.Tensor
    key_pos: torch.Tensor
    scaling: float
    observed: list


class CaptureCache(ChunkCache):
    """Prefill-only cache that captures instead of compressing (see the module docstring)."""

    def __init__(self, num_layers: int, compressors: list[Compressor], kernels: KernelChoice | None = None) -> None:
        super().__init__(num_layers)
        self.compressors = list(compressors)
        self.kernels = kernels  # of the caches it builds (None: each decides from the environment)
        self.captured: list[CapturedLayer | None] = [None] * num_layers

    @property
    def wants_hidden_states(self) -> bool:
        return any(c.needs_hidden_states for c in self.compressors) and self.captured[-1] is None

    def attend(self, module, query, key, value, scaling) -> torch.Tensor:
        idx = module.layer_idx
        if self.captured[idx] is not None:
            raise RuntimeError("a capture cache holds one prefill; later chunks go to the caches it builds")
        out = dense_prefill_attention(query, key, value, self.chunk_pos, scaling)
        hidden = self.hidden_states.pop(idx, None)
        observed = [self._keep(c.observe(query, self.chunk_pos, idx, hidden)) for c in self.compressors]
        self.captured[idx] = CapturedLayer(module, key, value, self.chunk_pos, scaling, observed)
        return out

    @staticmethod
    def _keep(observed: object) -> object:
        """A copy of query views, so that the prefill's full query tensor can be freed."""
        return observed.clone() if isinstance(observed, torch.Tensor) else observed

    def compressed(self, index: int, observed: list | None = None) -> VarLenCache:
        """The cache compressor ``index`` builds from the captured prefill (``observed``: per layer,
        reconstruction scores for a scorer that needs them)."""
        compressor = self.compressors[index]
        cache = VarLenCache(self.num_layers, compressor, self.kernels)
        prefill = cache.prefill  # a one-pass prefill, fed the captured layers instead of a forward
        for idx, layer in enumerate(self.captured):
            if layer is None:
                raise RuntimeError(f"layer {idx} was not captured (run the prefill first)")
            cache.chunk_pos = layer.key_pos
            prefill.layers.add(
                idx, layer.module, layer.observed[index], layer.key, layer.value, layer.key_pos, layer.scaling
            )
        if prefill.awaiting_passes is not None:
            if observed is None:
                raise ValueError(f"{compressor.config.method}: reconstruction scores are needed (observed=)")
            prefill.finish(observed)
        return cache

    def pending_layers(self) -> list[PendingLayer]:
        """The captured layers as pending layers (what the reconstruction passes read)."""
        return [PendingLayer(c.module, c.key, c.value, c.key_pos, c.scaling, None) for c in self.captured]
