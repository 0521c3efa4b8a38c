"""Cross-layer budgets without the dense cache: each layer compressed as it comes, earlier ones shrunk
(the ``streamed`` layer step of :mod:`.rules`).

A cross-layer allocation (``layer``: one top-k over the scores of every layer and KV head of a row,
arXiv 2510.13334, KVzip's global budget, arXiv 2505.23416) knows no layer's count before it has every
layer's scores, so the cache held every layer's dense K/V until the prefill's last layer. When the
scorer scores each layer in its own attention (``kvzap``, ``knorm``, the window scorers) that is not
needed:

* the counts the first l layers get among themselves (the same top-k of ``L * H_kv * b`` entries, over
  their scores alone) bound their final counts from above: a later layer's entries can push an entry
  out of the top-k, never bring one in (:meth:`~pipeline.kv.parts.Allocation.prefix_head_budgets`);
* a nested selection (top-k, CriticalKV; :attr:`~pipeline.kv.parts.Selection.nested`) choosing b'
  entries from the b it chose chooses what it would choose at b' from the layer's dense K/V.

So after each layer's attention :class:`StreamedBudgets` scores the layer (and keeps its (B, H_kv, n)
scores, a few MiB), takes the counts of the layers so far, compresses the new layer from its dense K/V
to its count and shrinks earlier layers to theirs, choosing from what each layer holds with
the scores (and the projected value norms, CriticalKV's) it was kept with. After the last layer the
counts are the final ones and every layer holds the entries the dense path keeps (tested). The counts
so far sum to at most ``L * H_kv * b`` per row; a shrink costs a selection, so earlier layers shrink
in batches, once a row holds one layer's entries (H_kv * n) beyond the counts so far. Besides the
final cache's size the prefill thus holds one layer's entries of slack, the current layer's dense
K/V and, while an earlier layer shrinks, that layer's padded copy.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..compress import PendingLayer
from ..parts import LayerContext
from ..storage.store import VarLenLayer
from .base import LayerStep, PrefillTarget
from .held import fit_width, kept_in_order, select_from_held
from .timing import BlockTimer


class StreamedBudgets(LayerStep):
    """The state of one prefill's streamed cross-layer compression into ``target`` (module docstring)."""

    def __init__(self, target: PrefillTarget) -> None:
        super().__init__(target)
        layers = target.num_layers
        self.scores: list[torch.Tensor] = []  # (B, H_kv, n) base scores of every layer so far
        self.contexts: list[LayerContext] = []  # their contexts without K/V (budgets, windows, lengths)
        self.modules: list[torch.nn.Module] = []
        self.held_scores: list[torch.Tensor | None] = [None] * layers  # (S, W) scores of the held entries
        self.held_norms: list[torch.Tensor | None] = [None] * layers  # (S, W) their norms (NaN: not computed)

    def add(self, idx: int, module, observed, key, value, key_pos, scaling: float) -> None:
        """One layer's dense prefill K/V (B, H_kv, n, D) after its attention: compressed to its count
        among the layers so far; earlier layers shrunk to theirs (timed); the prefill ends after the last."""
        with BlockTimer(key.device) as timer:
            self._add(idx, module, observed, key, value, key_pos, scaling)
        self.target.compress_seconds += timer.seconds
        if idx == self.target.num_layers - 1:
            self.target.end_prefill()

    def _add(self, idx: int, module, observed, key, value, key_pos, scaling: float) -> None:
        if idx != len(self.scores):
            raise RuntimeError(f"streamed cross-layer compression got layer {idx} after {len(self.scores)} layers")
        compressor = self.target.compressor
        ctx, scores = compressor.score_layer(idx, PendingLayer(module, key, value, key_pos, scaling, observed))
        self.scores.append(scores)
        # without the dense K/V (the projection's closure holds them too): budgets, windows and lengths
        self.contexts.append(replace(ctx, key=None, value=None, observed=None, projection=None))
        self.modules.append(module)
        counts = compressor.allocation.prefix_head_budgets(
            self.scores, self.contexts, self.target.num_layers, compressor.allocation_options
        )
        selection = compressor.select(ctx, scores, counts[idx])
        self.target.store[idx] = VarLenLayer.from_dense(key, value, key_pos, selection.keep)
        keep = (selection.keep & (key_pos >= 0)[:, None, :]).flatten(0, 1)  # (S, n), as the store holds them
        self.held_scores[idx] = kept_in_order(scores.flatten(0, 1), keep)
        norms = selection.norms
        if compressor.selection.weighs_by_value_norm:  # all of them: a shrink then needs no new norm
            norms = compressor.all_norms(ctx.value, selection.keep, ctx.projection, norms)
        if norms is not None:
            self.held_norms[idx] = kept_in_order(norms.flatten(0, 1), keep, "nan")
        self._shrink_earlier(idx, counts, ctx.lengths * scores.shape[1])

    def _shrink_earlier(self, idx: int, counts: list[torch.Tensor], slack: torch.Tensor) -> None:
        """Shrink the layers before ``idx`` to ``counts`` (B, H_kv) each: all of them after the last
        layer; before it only once a row holds more than ``slack`` (B,) entries (one layer's) beyond
        the counts so far, then the layers with the most excess first until no row holds more than
        half of it. A shrink costs a selection, so batching them this way halves their number on
        SmolLM2 at 4K (against shrinking every layer after every layer) for that slack."""
        if idx == self.target.num_layers - 1:
            for j in range(idx):
                self._shrink(j, counts[j])
            return
        held = [self._held(j).sum(-1) for j in range(idx + 1)]  # (B,) entries per row, per layer
        over = sum(held) - sum(c.sum(-1) for c in counts)  # (B,) held beyond the counts so far
        if not bool((over > slack).any()):
            return
        excess = [int((self._held(j) - counts[j]).clamp(min=0).sum()) for j in range(idx)]
        for j in sorted(range(idx), key=lambda j: -excess[j]):
            if not bool((over > slack // 2).any()):
                return
            self._shrink(j, counts[j])
            over = over - (held[j] - self._held(j).sum(-1))

    def _held(self, idx: int) -> torch.Tensor:
        """(B, H_kv) entries layer ``idx`` holds."""
        layer = self.target.store[idx]
        return layer.length.view(layer.num_rows, layer.num_heads)

    def _shrink(self, idx: int, counts: torch.Tensor) -> None:
        """Layer ``idx`` keeps ``counts`` (B, H_kv) of the entries it holds, chosen as the selection
        would choose them from its dense K/V (nested); nothing happens where no count fell."""
        layer = self.target.store[idx]
        if not bool((counts.reshape(-1) < layer.length).any()):
            return
        keys, values, positions = layer.padded_view()
        width = positions.shape[1]
        scores = fit_width(self.held_scores[idx], width, float("-inf"))
        known = None if self.held_norms[idx] is None else fit_width(self.held_norms[idx], width, float("nan"))
        ctx = self.contexts[idx]
        keep, norms = select_from_held(
            self.target.compressor, idx, self.modules[idx], scores.view(*counts.shape, width), counts, keys, values,
            ctx.lengths, ctx.row_window, known,
        )  # fmt: skip
        keep = keep.reshape(positions.shape) & (positions >= 0)
        del keys, values  # the padded copy (a ragged layer's gather) goes before the compacted buffers exist
        layer.compact(keep)
        self.held_scores[idx] = kept_in_order(scores, keep)
        if norms is not None:
            self.held_norms[idx] = kept_in_order(norms.reshape(keep.shape), keep, "nan")
