"""Per-layer compression of a prefilled context: score -> per-head budgets -> selection.

:class:`Compressor` is built once per engine from a :class:`~pipeline.config.CompressionConfig`
(and HeadKV priors as a tensor); ``compress_layer`` is called by the cache right after a layer's
prefill attention, while the dense K/V of that layer are still at hand, and returns which entries
each (row, KV head) keeps. Nothing here touches files, Ray or the model beyond ``o_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import CompressionConfig
from .budgets import adakv_head_budgets, headkv_head_budgets, row_budgets, uniform_head_budgets
from .criticalkv import (
    NormStats,
    OutputProjection,
    exact_l1_norms,
    l2_norms,
    norms_for_mask,
    topk_select,
    two_stage_select,
)
from .scorers import snapkv_scores, streamingllm_scores


@dataclass
class LayerSelection:
    """keep: (B, H_kv, n) bool; norms: (B, H_kv, n) float32 projected value norms or None
    (NaN where not computed); head_budget: (B, H_kv) long."""

    keep: torch.Tensor
    norms: torch.Tensor | None
    head_budget: torch.Tensor


class Compressor:
    """Applies one compression method to every layer of a prefill."""

    def __init__(self, config: CompressionConfig, head_priors: torch.Tensor | None = None) -> None:
        if config.uses_headkv and head_priors is None:
            raise ValueError(f"method {config.method!r} needs HeadKV priors (head_priors)")
        self.config = config
        self.head_priors = head_priors
        self.norm_stats = NormStats()
        self._projections: dict[int, OutputProjection] = {}

    @property
    def needs_value_norms(self) -> bool:
        return self.config.max_cache_tokens is not None

    def projection(self, layer_idx: int, module: torch.nn.Module, num_kv_heads: int, head_dim: int) -> OutputProjection:
        """W_O slices of a layer in float32 (cached: weights do not change during inference)."""
        proj = self._projections.get(layer_idx)
        if proj is None:
            proj = OutputProjection.from_weight(module.o_proj.weight, num_kv_heads, head_dim)
            self._projections[layer_idx] = proj
        return proj

    def compress_layer(
        self,
        layer_idx: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_pos: torch.Tensor,
        scaling: float,
    ) -> LayerSelection:
        """query: (B, H_q, n, D); key/value: (B, H_kv, n, D); key_pos: (B, n) (-1 = padding)."""
        cfg = self.config
        bsz, h_kv, n, dim = key.shape
        lengths = (key_pos >= 0).sum(-1)
        valid = (key_pos >= 0)[:, None, :].expand(bsz, h_kv, n)
        need_norms = self.needs_value_norms
        proj = self.projection(layer_idx, module, h_kv, dim) if (cfg.uses_criticalkv or need_norms) else None

        if not cfg.compresses:
            keep = valid.clone()
            budget = lengths[:, None].expand(bsz, h_kv).clone()
            return LayerSelection(keep, self._all_norms(value, keep, proj) if need_norms else None, budget)

        row_b, row_w = row_budgets(lengths, cfg.cache_size, cfg.budget, cfg.window)
        if cfg.scorer == "streamingllm":
            scores = streamingllm_scores(key_pos, h_kv, row_w, cfg.sink_tokens)
        else:
            scores = snapkv_scores(query, key, key_pos, row_w, cfg.kernel, cfg.pooling, scaling)

        if cfg.uses_adakv:
            head_budget = adakv_head_budgets(scores, row_b, cfg.alpha_safeguard)
        elif cfg.uses_headkv:
            head_budget = headkv_head_budgets(self.head_priors, layer_idx, row_b, row_w, lengths, cfg.alpha_safeguard)
        else:
            head_budget = uniform_head_budgets(row_b, h_kv)

        norms = None
        if cfg.uses_criticalkv:
            keep, norms = two_stage_select(
                scores, head_budget, row_w, value, proj, cfg.first_stage_ratio, cfg.epsilon, cfg.norm, self.norm_stats
            )
        else:
            keep = topk_select(scores, head_budget)
        if need_norms:
            norms = self._all_norms(value, keep, proj, norms)
        return LayerSelection(keep, norms, head_budget)

    def _all_norms(
        self, value: torch.Tensor, keep: torch.Tensor, proj: OutputProjection, norms: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Exact projected norms for every kept entry (needed by the decode-time cap)."""
        if norms is None:
            norms = torch.full(keep.shape, float("nan"), dtype=torch.float32, device=keep.device)
        if self.config.norm == "l2" and bool(torch.isnan(norms[keep]).any()):
            return torch.where(torch.isnan(norms), l2_norms(value, proj), norms)
        norms_for_mask(value, proj, keep & torch.isnan(norms), norms)
        return norms

    def new_entry_norms(self, layer_idx: int, value: torch.Tensor) -> torch.Tensor:
        """Projected norms of freshly appended entries (decode cap). value: (B, H_kv, T, D) -> (B, H_kv, T)."""
        proj = self._projections[layer_idx]
        bsz, h_kv, t, _ = value.shape
        if self.config.norm == "l2":
            return l2_norms(value, proj)
        out = torch.empty(bsz, h_kv, t, dtype=torch.float32, device=value.device)
        for k in range(h_kv):
            out[:, k] = exact_l1_norms(value[:, k].reshape(-1, value.shape[-1]), proj, k).view(bsz, t)
        return out
