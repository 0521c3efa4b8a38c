"""Compression of a prefilled context: score -> per-head budgets -> selection.

:class:`Compressor` is built once per engine from a :class:`~pipeline.kv.config.CompressionConfig`
(plus HeadKV priors as a tensor and the model's rotary embedding). For each layer of a prefill the
cache calls :meth:`observe` while the layer's attention runs (the scorer keeps what it needs of the
queries), then either

* :meth:`compress_observed` right away when the method decides in ``Phase.LAYER`` (the dense K/V
  of one layer exist at a time), or, when it decides later (:attr:`phase`: ``PREFILL`` for a
  cross-layer allocation, ``PASSES`` for a scorer that needs context-reconstruction passes; see
  :mod:`pipeline.kv.phases`), keeps a :class:`PendingLayer` and calls :meth:`compress_model` once
  every layer is there (the dense cache of every layer exists until then).

Both return which entries each (row, KV head) keeps. Nothing here touches files, Ray or the model
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
from .scorers.common import window_mask
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
    def needs_value_norms(self) -> bool:
        """Norms of every kept entry are needed after the prefill (the decode-time cap)."""
        return self.config.max_cache_tokens is not None

    @property
    def phase(self) -> Phase:
        """When the method decides (:mod:`pipeline.kv.phases`): the latest of its parts' phases."""
        return self.config.phase

    @property
    def streams_across_layers(self) -> bool:
        """A cross-layer method whose layers are compressed as they come (:mod:`pipeline.kv.streamed`):
        a scorer that scores each layer in its attention, an allocation that :attr:`~Allocation.streams`
        and a :attr:`~Selection.nested` selection; not under the decode-time cap (it starts from one
        selection's norms of every kept entry)."""
        return (
            self.config.compresses
            and self.phase is Phase.PREFILL
            and self.scorer.decides is Phase.LAYER
            and self.allocation.streams
            and self.selection.nested
            and not self.needs_value_norms
        )

    @property
    def needs_hidden_states(self) -> bool:
        """The scorer reads each layer's attention input during the prefill (KVzap)."""
        return self.scorer is not None and self.scorer.needs_hidden_states

    @property
    def observed_queries(self) -> int:
        """How many of the last prefill queries the scorer keeps (a capture for sweeps keeps as many)."""
        if self.scorer is None:
            return 0
        return self.scorer.observed_queries(self.config.window, self.scorer_options)

    def projection(self, layer_idx: int, module: torch.nn.Module, num_kv_heads: int, head_dim: int) -> OutputProjection:
        """W_O slices of a layer in float32. Only the latest layer's are cached (a float32 copy of every
        layer's ``o_proj`` would be 38 MiB on SmolLM2, GiBs on 8B models, held for the engine's life;
        layers are selected one after the other), except under the decode-time cap, which reads every
        layer's at every decode step."""
        proj = self._projections.get(layer_idx)
        if proj is None:
            proj = OutputProjection.from_weight(module.o_proj.weight, num_kv_heads, head_dim)
            if not self.needs_value_norms:
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

    @property
    def observes_in_slices(self) -> bool:
        """:meth:`observe` can run on consecutive slices of a layer's queries (:meth:`merge_observed`)."""
        return self.scorer is None or self.scorer.observes_in_slices

    def merge_observed(self, earlier: object, later: object) -> object:
        """What :meth:`observe` gives for two consecutive query slices of one layer together."""
        if self.scorer is None:
            return None
        return self.scorer.merge_observed(earlier, later, self.config.window, self.scorer_options)

    def compress_layer(self, layer_idx, module, query, key, value, key_pos, scaling, hidden=None) -> LayerSelection:
        """:meth:`observe` + :meth:`compress_observed`. query: (B, H_q, m, D) (the last m >=
        :attr:`observed_queries` prefill queries, or all of them); key/value: (B, H_kv, n, D)."""
        observed = self.observe(query, key_pos, layer_idx, hidden)
        return self.compress_observed(layer_idx, module, observed, key, value, key_pos, scaling)

    def compress_observed(self, layer_idx, module, observed, key, value, key_pos, scaling) -> LayerSelection:
        """Which entries of one layer each (row, KV head) keeps (per-layer methods).

        key/value: (B, H_kv, n, D) post-RoPE; key_pos: (B, n) (-1 = padding); observed: from :meth:`observe`.
        """
        if self.phase is not Phase.LAYER:
            raise RuntimeError(f"method {self.config.method!r} compresses all layers at once (compress_model)")
        pending = PendingLayer(module, key, value, key_pos, scaling, observed)
        if not self.config.compresses:
            return self._keep_all(layer_idx, pending)
        ctx = self._context(layer_idx, pending)
        scores = self.scorer.score(ctx, self.scorer_options)
        return self.select(ctx, scores, self.allocation.head_budgets(scores, ctx, self.allocation_options))

    def compress_model(self, layers: list[PendingLayer]) -> list[LayerSelection]:
        """Which entries of every layer each (row, KV head) keeps, deciding budgets across layers."""
        contexts, scores = zip(*(self.score_layer(idx, layer) for idx, layer in enumerate(layers)))
        budgets = self.allocation.model_head_budgets(list(scores), list(contexts), self.allocation_options)
        return [self.select(ctx, s, b) for ctx, s, b in zip(contexts, scores, budgets)]

    def score_layer(self, layer_idx: int, layer: PendingLayer) -> tuple[LayerContext, torch.Tensor]:
        """One layer's context and base scores (B, H_kv, n)."""
        ctx = self._context(layer_idx, layer)
        return ctx, self.scorer.score(ctx, self.scorer_options)

    def prefix_budgets(self, scores: list[torch.Tensor], contexts: list[LayerContext], num_layers: int) -> list:
        """Counts (B, H_kv) of the first layers of ``num_layers`` from their scores: upper bounds of
        their final counts (:meth:`~pipeline.kv.parts.Allocation.prefix_head_budgets`)."""
        return self.allocation.prefix_head_budgets(scores, contexts, num_layers, self.allocation_options)

    def raw_scores(self, layer_idx, module, observed, key, value, key_pos, scaling, context_lengths) -> torch.Tensor:
        """Base scores of one prefill chunk's entries (chunked prefill), (B, H_kv, T): as the scorer
        scores the chunk, except that the chunk's window entries get the score they have without a
        window (the running window is applied to the union in :meth:`compress_union`).
        context_lengths: (B,) each row's whole context."""
        ctx = self._context(layer_idx, PendingLayer(module, key, value, key_pos, scaling, observed), context_lengths)
        with_window = self.scorer.score(ctx, self.scorer_options)  # as the unchunked prefill scores the chunk
        in_window = window_mask(key_pos, ctx.row_window)[:, None, :]
        ctx.row_window = torch.zeros_like(ctx.row_window)
        bare = self.scorer.score(ctx, self.scorer_options)  # the window's own entries, for when they leave the window
        return torch.where(in_window, bare, with_window)

    def union_budgets(
        self, positions, unions, seen: torch.Tensor, lengths: torch.Tensor, layers: list[int]
    ) -> tuple[list, list, torch.Tensor]:
        """Per-head counts of every layer after a prefill chunk (:mod:`pipeline.kv.chunked`).

        positions: per layer (S, L) original positions of the candidates (S = B * H_kv; -1: none);
        unions: per layer (S, L) raw scores; seen: (B,) tokens of each row so far (the most recent
        ``window`` of them are always kept); lengths: (B,) each row's whole context. The allocation
        splits the budget of ``lengths`` (``chunk_budget`` final) or of ``seen`` (running); no head
        keeps more than its candidates. layers: the layer indices (every layer for a cross-layer
        allocation). Returns (scores (B, H_kv, L) with the window at +inf, per layer; counts
        (B, H_kv) per layer; row windows (B,)).
        """
        cfg = self.config
        bsz = seen.shape[0]
        row_b, row_w = row_budgets(seen, cfg.cache_size, cfg.budget, cfg.window)
        budget_of = seen
        if cfg.chunk_budget == "final":
            budget_of = lengths.to(seen.device)
            row_b, _ = row_budgets(budget_of, cfg.cache_size, cfg.budget, cfg.window)
        scores, contexts = [], []
        for idx, pos, union in zip(layers, positions, unions):
            pos = pos.view(bsz, -1, pos.shape[-1])
            recent = (pos >= (seen - row_w)[:, None, None]) & (pos >= 0)
            scores.append(union.view(pos.shape).masked_fill(recent, float("inf")))
            ctx = LayerContext(
                idx, None, None, pos, 1.0, budget_of, row_b, row_w, None, None, self.head_priors, self.kvzap
            )
            contexts.append(ctx)  # an allocation reads scores, budgets, lengths and priors, never K/V
        if self.phase is Phase.PREFILL:  # across layers, which hold different numbers of candidates: one width
            width = max(sc.shape[-1] for sc in scores)
            padded = [torch.nn.functional.pad(sc, (0, width - sc.shape[-1]), value=float("-inf")) for sc in scores]
            budgets = self.allocation.model_head_budgets(padded, contexts, self.allocation_options)
        else:
            opts = self.allocation_options
            budgets = [self.allocation.head_budgets(sc, ctx, opts) for sc, ctx in zip(scores, contexts)]
        held = [(ctx.key_pos >= 0).sum(-1) for ctx in contexts]  # (B, H_kv) candidates of each head
        return scores, [torch.minimum(b.to(h.device), h) for b, h in zip(budgets, held)], row_w

    def union_select(
        self, idx, module, scores, budget, keys, values, seen, row_window, known_norms=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Which of one layer's candidates are kept: keys/values (S, L, D) per segment, scores from
        :meth:`union_budgets`, known_norms (S, L) projected value norms already computed (NaN where
        not) or None; returns keep (B, H_kv, L) bool and the norms the selection knows (or None)."""
        bsz, heads, width = scores.shape
        dim = keys.shape[-1]
        ctx = LayerContext(
            layer_idx=idx,
            key=keys.view(bsz, heads, width, dim),
            value=values.view(bsz, heads, width, dim),
            key_pos=None,
            scaling=1.0,
            lengths=seen,
            row_budget=None,
            row_window=row_window,
            observed=None,
            projection=lambda: self.projection(idx, module, heads, dim),
            head_priors=self.head_priors,
            kvzap=self.kvzap,
            selection_weighs_values=self.selection.weighs_by_value_norm,
            known_norms=None if known_norms is None else known_norms.view(bsz, heads, width),
        )
        selected = self.select(ctx, scores, budget)
        return selected.keep, selected.norms

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
            context_lengths=context_lengths,
        )

    def select(self, ctx: LayerContext, scores: torch.Tensor, head_budget: torch.Tensor) -> LayerSelection:
        """The selection's kept entries of one layer: scores (B, H_kv, n), head_budget (B, H_kv)."""
        keep, norms = self.selection.select(scores, head_budget, ctx, self.selection_options, self.norm_stats)
        if self.needs_value_norms:
            norms = self._all_norms(ctx.value, keep, ctx.projection, norms)
        return LayerSelection(keep, norms, head_budget)

    def kept_norms(self, ctx: LayerContext, selection: LayerSelection) -> torch.Tensor | None:
        """(B, H_kv, n) projected value norms of every kept entry (NaN elsewhere) for a selection that
        weighs by them (None otherwise): what it computed, completed."""
        if not self.selection.weighs_by_value_norm:
            return selection.norms
        return self._all_norms(ctx.value, selection.keep, ctx.projection, selection.norms)

    def _keep_all(self, layer_idx: int, layer: PendingLayer) -> LayerSelection:
        bsz, h_kv, n, dim = layer.key.shape
        keep = (layer.key_pos >= 0)[:, None, :].expand(bsz, h_kv, n).clone()
        budget = (layer.key_pos >= 0).sum(-1)[:, None].expand(bsz, h_kv).clone()
        norms = None
        if self.needs_value_norms:
            norms = self._all_norms(layer.value, keep, lambda: self.projection(layer_idx, layer.module, h_kv, dim))
        return LayerSelection(keep, norms, budget)

    def _all_norms(
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
