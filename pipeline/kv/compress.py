"""Per-layer compression of a prefilled context: score -> per-head budgets -> selection.

:class:`Compressor` is built once per engine from a :class:`~pipeline.kv.config.CompressionConfig`
(and HeadKV priors as a tensor). For each layer of a prefill the cache calls :meth:`observe` while
the layer's attention runs (the scorer keeps what it needs of the queries), then
:meth:`compress_observed` while the dense K/V of that layer are still at hand; it returns which
entries each (row, KV head) keeps. :meth:`compress_layer` does both in one call. Nothing here
touches files, Ray or the model beyond ``o_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .allocation import ALLOCATIONS, row_budgets
from .config import CompressionConfig
from .parts import LayerContext
from .scorers import SCORERS
from .selection import SELECTIONS
from .value_norms import NormStats, OutputProjection, entry_norms, norms_for_mask


@dataclass
class LayerSelection:
    """keep: (B, H_kv, n) bool; norms: (B, H_kv, n) float32 projected value norms or None
    (NaN where not computed); head_budget: (B, H_kv) long."""

    keep: torch.Tensor
    norms: torch.Tensor | None
    head_budget: torch.Tensor


class Compressor:
    """Applies one compression method to every layer of a prefill (see the module docstring)."""

    def __init__(self, config: CompressionConfig, head_priors: torch.Tensor | None = None) -> None:
        if config.needs_head_priors and config.compresses and head_priors is None:
            raise ValueError(f"method {config.method!r} needs HeadKV priors (compression.head_priors)")
        self.config = config
        self.head_priors = head_priors
        self.norm_stats = NormStats()
        self._projections: dict[int, OutputProjection] = {}
        self.scorer = SCORERS[config.scorer] if config.compresses else None
        self.allocation = ALLOCATIONS[config.allocation]
        self.selection = SELECTIONS[config.selection]

    @property
    def needs_value_norms(self) -> bool:
        """Norms of every kept entry are needed after the prefill (the decode-time cap)."""
        return self.config.max_cache_tokens is not None

    @property
    def observed_queries(self) -> int:
        """How many of the last prefill queries the scorer keeps (a capture for sweeps keeps as many)."""
        return self.scorer.observed_queries(self.config) if self.scorer is not None else 0

    def projection(self, layer_idx: int, module: torch.nn.Module, num_kv_heads: int, head_dim: int) -> OutputProjection:
        """W_O slices of a layer in float32 (cached: weights do not change during inference)."""
        proj = self._projections.get(layer_idx)
        if proj is None:
            proj = OutputProjection.from_weight(module.o_proj.weight, num_kv_heads, head_dim)
            self._projections[layer_idx] = proj
        return proj

    def observe(self, query: torch.Tensor, key_pos: torch.Tensor) -> object:
        """What the scorer keeps of one layer's prefill queries (B, H_q, n, D)."""
        return self.scorer.observe(query, key_pos, self.config) if self.scorer is not None else None

    def compress_layer(self, layer_idx, module, query, key, value, key_pos, scaling) -> LayerSelection:
        """:meth:`observe` + :meth:`compress_observed`. query: (B, H_q, m, D) (the last m >=
        :attr:`observed_queries` prefill queries, or all of them); key/value: (B, H_kv, n, D)."""
        return self.compress_observed(layer_idx, module, self.observe(query, key_pos), key, value, key_pos, scaling)

    def compress_observed(
        self,
        layer_idx: int,
        module: torch.nn.Module,
        observed: object,
        key: torch.Tensor,
        value: torch.Tensor,
        key_pos: torch.Tensor,
        scaling: float,
    ) -> LayerSelection:
        """Which entries of one layer each (row, KV head) keeps.

        key/value: (B, H_kv, n, D) post-RoPE; key_pos: (B, n) (-1 = padding); observed: from :meth:`observe`.
        """
        cfg = self.config
        bsz, h_kv, n, dim = key.shape
        lengths = (key_pos >= 0).sum(-1)
        if not cfg.compresses:
            keep = (key_pos >= 0)[:, None, :].expand(bsz, h_kv, n).clone()
            budget = lengths[:, None].expand(bsz, h_kv).clone()
            norms = (
                self._all_norms(value, keep, self.projection(layer_idx, module, h_kv, dim))
                if self.needs_value_norms
                else None
            )
            return LayerSelection(keep, norms, budget)
        row_b, row_w = row_budgets(lengths, cfg.cache_size, cfg.budget, cfg.window)
        ctx = LayerContext(
            layer_idx=layer_idx,
            key=key,
            value=value,
            key_pos=key_pos,
            scaling=scaling,
            lengths=lengths,
            row_budget=row_b,
            row_window=row_w,
            observed=observed,
            projection=lambda: self.projection(layer_idx, module, h_kv, dim),
            head_priors=self.head_priors,
        )
        scores = self.scorer.score(ctx, cfg)
        head_budget = self.allocation.head_budgets(scores, ctx, cfg)
        keep, norms = self.selection.select(scores, head_budget, ctx, cfg, self.norm_stats)
        if self.needs_value_norms:
            norms = self._all_norms(value, keep, ctx.projection(), norms)
        return LayerSelection(keep, norms, head_budget)

    def _all_norms(
        self, value: torch.Tensor, keep: torch.Tensor, proj: OutputProjection, norms: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Projected norms for every kept entry (the decode-time cap needs them)."""
        if norms is None:
            norms = torch.full(keep.shape, float("nan"), dtype=torch.float32, device=keep.device)
        missing = keep & torch.isnan(norms)
        if not bool(missing.any()):
            return norms
        if self.config.norm == "l2":
            return torch.where(torch.isnan(norms), entry_norms(value, proj, "l2"), norms)
        norms_for_mask(value, proj, missing, norms)
        return norms

    def new_entry_norms(self, layer_idx: int, value: torch.Tensor) -> torch.Tensor:
        """Projected norms of freshly appended entries (decode cap). value: (B, H_kv, T, D) -> (B, H_kv, T)."""
        return entry_norms(value, self._projections[layer_idx], self.config.norm)
