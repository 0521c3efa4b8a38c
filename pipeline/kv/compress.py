"""Compression of a prefilled context: context -> score -> per-head budgets -> selection.

:class:`Compressor` is built once per engine from a :class:`~pipeline.kv.config.CompressionConfig`
(plus HeadKV priors as a tensor and the model's rotary embedding). For each layer of a prefill the
prefill strategy (:mod:`pipeline.kv.prefill`) calls :meth:`observe` while the layer's attention runs
(the scorer keeps what it needs of the queries), then either

* :meth:`compress_observed` right away when the method decides in ``Phase.LAYER`` (the dense K/V
  of one layer exist at a time), or, when it decides later (:attr:`phase`: ``PREFILL`` for a
  cross-layer allocation, ``PASSES`` for a scorer that needs context-reconstruction passes; see
  :mod:`pipeline.kv.phases`), :meth:`compress_model` once every layer is there
  (:class:`PendingLayer`; the dense cache of every layer exists until then);
* the strategies that decide in steps (a streamed cross-layer budget, a chunked prefill) call the
  steps themselves: :meth:`score_layer`, the allocation, :meth:`select`.

Each returns which entries each (row, KV head) keeps. Nothing here touches files, Ray or the model
beyond ``o_proj``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .allocation import ALLOCATIONS, row_budgets
from .config import CompressionConfig
from .kvzap_model import KVzapModel
from .parts import LayerContext, LayerInputs, Rotary
from .phases import Phase
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


@dataclass
class PendingLayer:
    """One layer's prefill waiting for a method that decides after ``Phase.LAYER``: module, dense K/V (B, H_kv, n, D),
    positions (B, n) (-1 padding), scaling, and what the scorer observed (or, for reconstruction
    scorers, the pass scores once they are known)."""

    module: torch.nn.Module
    key: torch.Tensor
    value: torch.Tensor
    key_pos: torch.Tensor
    scaling: float
    observed: object


class Compressor:
    """Applies one compression method to every layer of a prefill (see the module docstring)."""

    def __init__(
        self,
        config: CompressionConfig,
        head_priors: torch.Tensor | None = None,
        rotary: Rotary | None = None,
        kvzap: KVzapModel | None = None,
    ) -> None:
        if config.needs_head_priors and config.compresses and head_priors is None:
            raise ValueError(f"method {config.method!r} needs HeadKV priors (compression.head_priors)")
        if config.needs_kvzap_model and config.compresses and kvzap is None:
            raise ValueError(f"method {config.method!r} needs a KVzap model (compression.kvzap_model)")
        self.config = config
        self.head_priors = head_priors
        self.kvzap = kvzap
        self.rotary = rotary
        self.norm_stats = NormStats()
        self._projections: dict[int, OutputProjection] = {}
        self.scorer = SCORERS[config.scorer] if config.compresses else None
        self.allocation = ALLOCATIONS[config.allocation]
        self.selection = SELECTIONS[config.selection]
        # each part's own typed knobs, read once (a part never sees the rest of the config)
        self.scorer_options = self.scorer.options_from(config) if self.scorer is not None else None
        self.allocation_options = self.allocation.options_from(config)
        self.selection_options = self.selection.options_from(config)

    @property
    def phase(self) -> Phase:
        """When the method decides (:mod:`pipeline.kv.phases`): the latest of its parts' phases."""
        return self.config.phase

    @property
    def needs_hidden_states(self) -> bool:
        """The scorer reads each layer's attention input during the prefill (KVzap)."""
        return self.scorer is not None and self.scorer.needs_hidden_states

    @property
    def scorer_weighs_values(self) -> bool:
        """The scorer's scores already weigh the projected value norm (KVzap; ``LayerContext``)."""
        return self.scorer is not None and self.scorer.weighs_by_value_norm

    def projection(self, layer_idx: int, module: torch.nn.Module, num_kv_heads: int, head_dim: int) -> OutputProjection:
        """W_O slices of a layer in float32. Only the latest layer's are cached (a float32 copy of every
        layer's ``o_proj`` would be 38 MiB on SmolLM2, GiBs on 8B models, held for the engine's life;
        layers are selected one after the other), except under the decode-time cap, which reads every
        layer's at every decode step."""
        proj = self._projections.get(layer_idx)
        if proj is None:
            proj = OutputProjection.from_weight(module.o_proj.weight, num_kv_heads, head_dim)
            if not self._keeps_every_norm:
                self._projections.clear()
            self._projections[layer_idx] = proj
        return proj

    def observe(
        self, query: torch.Tensor, key_pos: torch.Tensor, layer_idx: int = 0, hidden: torch.Tensor | None = None
    ) -> object:
        """What the scorer keeps of one layer's prefill queries (B, H_q, n, D) (and, for a scorer
        that needs them, of its attention input ``hidden`` (B, n, hidden))."""
        if self.scorer is None:
            return None
        inputs = LayerInputs(layer_idx, hidden, self.kvzap)
        return self.scorer.observe(query, key_pos, self.scorer_options, self.config.window, self.rotary, inputs=inputs)

    def compress_observed(self, layer_idx, module, observed, key, value, key_pos, scaling) -> LayerSelection:
        """Which entries of one layer each (row, KV head) keeps (per-layer methods).

        key/value: (B, H_kv, n, D) post-RoPE; key_pos: (B, n) (-1 = padding); observed: from :meth:`observe`.
        """
        if self.phase is not Phase.LAYER:
            raise RuntimeError(f"method {self.config.method!r} compresses all layers at once (compress_model)")
        pending = PendingLayer(module, key, value, key_pos, scaling, observed)
        if not self.config.compresses:
            return self._keep_all(layer_idx, pending)
        ctx, scores = self.score_layer(layer_idx, pending)
        selection = self.select(ctx, scores, self.allocation.head_budgets(scores, ctx, self.allocation_options))
        self.release_projections()
        return selection

    def compress_model(self, layers: list[PendingLayer]) -> list[LayerSelection]:
        """Which entries of every layer each (row, KV head) keeps, deciding budgets across layers."""
        contexts, scores = zip(*(self.score_layer(idx, layer) for idx, layer in enumerate(layers)))
        budgets = self.allocation.model_head_budgets(list(scores), list(contexts), self.allocation_options)
        selections = [self.select(ctx, s, b) for ctx, s, b in zip(contexts, scores, budgets)]
        self.release_projections()
        return selections

    def release_projections(self) -> None:
        """Drop the cached W_O slices once a layer's selection is made (rebuilt from the weights, the same
        values, when a later selection needs them), so that they are not held through the next layer's
        forward, where a prefill peaks (1.3 MiB on SmolLM2); kept under the decode-time cap, which reads
        every layer's at every decode step."""
        if not self._keeps_every_norm:
            self._projections.clear()

    def score_layer(
        self, layer_idx: int, layer: PendingLayer, context_lengths=None
    ) -> tuple[LayerContext, torch.Tensor]:
        """One layer's context (what the parts see) and base scores (B, H_kv, n); context_lengths: (B,)
        each row's whole context when the layer holds only part of it (a chunked prefill's chunk)."""
        ctx = self._context(layer_idx, layer, context_lengths)
        return ctx, self.scorer.score(ctx, self.scorer_options)

    def _context(self, layer_idx: int, layer: PendingLayer, context_lengths=None) -> LayerContext:
        cfg = self.config
        _, h_kv, _, dim = layer.key.shape
        lengths = (layer.key_pos >= 0).sum(-1)
        row_b, row_w = row_budgets(lengths, cfg.cache_size, cfg.budget, cfg.window)
        return LayerContext(
            layer_idx=layer_idx,
            key=layer.key,
            value=layer.value,
            key_pos=layer.key_pos,
            scaling=layer.scaling,
            lengths=lengths,
            row_budget=row_b,
            row_window=row_w,
            observed=layer.observed,
            projection=lambda: self.projection(layer_idx, layer.module, h_kv, dim),
            head_priors=self.head_priors,
            kvzap=self.kvzap,
            selection_weighs_values=self.selection.weighs_by_value_norm,
            scorer_weighs_values=self.scorer_weighs_values,
            context_lengths=context_lengths,
        )

    def select(self, ctx: LayerContext, scores: torch.Tensor, head_budget: torch.Tensor) -> LayerSelection:
        """The selection's kept entries of one layer: scores (B, H_kv, n), head_budget (B, H_kv)."""
        keep, norms = self.selection.select(scores, head_budget, ctx, self.selection_options, self.norm_stats)
        if self._keeps_every_norm:
            norms = self.all_norms(ctx.value, keep, ctx.projection, norms)
        return LayerSelection(keep, norms, head_budget)

    def _keep_all(self, layer_idx: int, layer: PendingLayer) -> LayerSelection:
        bsz, h_kv, n, dim = layer.key.shape
        keep = (layer.key_pos >= 0)[:, None, :].expand(bsz, h_kv, n).clone()
        budget = (layer.key_pos >= 0).sum(-1)[:, None].expand(bsz, h_kv).clone()
        norms = None
        if self._keeps_every_norm:
            norms = self.all_norms(layer.value, keep, lambda: self.projection(layer_idx, layer.module, h_kv, dim))
        return LayerSelection(keep, norms, budget)

    @property
    def _keeps_every_norm(self) -> bool:
        """Norms of every kept entry are needed after the prefill (the decode-time cap)."""
        return self.config.max_cache_tokens is not None

    def all_norms(
        self,
        value: torch.Tensor,
        keep: torch.Tensor,
        projection: Callable[[], OutputProjection],
        norms: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Projected norms for every kept entry (the decode-time cap and streamed shrinks need them);
        ``projection`` builds the layer's W_O slices, called only when a norm is missing."""
        if norms is None:
            norms = torch.full(keep.shape, float("nan"), dtype=torch.float32, device=keep.device)
        missing = keep & torch.isnan(norms)
        if not bool(missing.any()):
            return norms
        proj = projection()
        if self.config.norm == "l2":
            return torch.where(torch.isnan(norms), entry_norms(value, proj, "l2"), norms)
        norms_for_mask(value, proj, missing, norms)
        return norms

    def new_entry_norms(self, layer_idx: int, value: torch.Tensor) -> torch.Tensor:
        """Projected norms of freshly appended entries (decode cap). value: (B, H_kv, T, D) -> (B, H_kv, T)."""
        return entry_norms(value, self._projections[layer_idx], self.config.norm)
