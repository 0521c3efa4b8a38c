"""Cross-layer allocation (Layer-DefensiveKV, Feng et al., arXiv 2510.13334; also KVzip's global
budget, arXiv 2505.23416): one top-k over the base scores of every layer and KV head of a row
(k = L * H_kv * b) decides how many entries each layer and head keeps. The total kept stays
``L * H_kv * b`` per row; observation-window entries score +inf and always win. No floor per layer
or head (as published). The final counts need every layer's scores. With a scorer that scores each
layer in its own attention and a nested selection the cache compresses each layer to its count among
the layers so far and shrinks the earlier ones as later layers come (:mod:`pipeline.kv.prefill.streamed_budgets`):
the same kept entries, holding the final cache's entries plus one layer's dense K/V. Otherwise
(KVzip's passes, the decode-time cap) the dense cache is held until the prefill ends.
"""

from __future__ import annotations

import torch

from ..parts import Allocation, LayerContext
from ..phases import Phase


def layer_head_budgets(
    scores: list[torch.Tensor], row_budget: torch.Tensor, num_layers: int | None = None
) -> list[torch.Tensor]:
    """scores: per layer (B, H, n) base scores (+inf window, -inf padding); row_budget: (B,);
    num_layers: the model's layers when ``scores`` holds only the first of them (default: len(scores)).

    Returns per layer (B, H) long counts; summed over layers and heads they are ``num_layers * H *
    row_budget`` (fewer only when a row has fewer keepable entries). Ties go to the earlier layer, head,
    position. Over the first layers only, the counts are those layers' share of the top-k among them,
    which no later layer's entries can raise: an upper bound of their final counts.
    """
    stacked = torch.stack(scores, dim=1)  # (B, L, H, n)
    bsz, layers, heads, n = stacked.shape
    total = layers if num_layers is None else num_layers
    chosen = top_entries(stacked.reshape(bsz, -1), row_budget * total * heads).view(bsz, layers, heads, n)
    counts = chosen.sum(-1)  # (B, L, H)
    return [counts[:, layer] for layer in range(layers)]


def top_entries(flat: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, N) bool: the ``k[b]`` largest finite-or-+inf values of each row, ties to the lower index
    (what ``rank_desc(flat) < k`` keeps, without sorting the whole row: one k-th value and a count)."""
    chosen = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    for b in range(flat.shape[0]):
        row, valid = flat[b], flat[b] > float("-inf")
        take = min(int(k[b]), int(valid.sum()))
        if take <= 0:
            continue
        kth = torch.kthvalue(row, row.numel() - take + 1).values  # the take-th largest (-inf are the smallest)
        above = row > kth
        ties = (row == kth) & valid
        chosen[b] = above | (ties & (torch.cumsum(ties, 0) <= take - int(above.sum())))
    return chosen


class CrossLayerAllocation(Allocation):
    """An allocation whose counts need every layer's scores and that streams: its counts over the
    first layers (:meth:`counts` with the model's layer count) bound their final counts from above."""

    decides = Phase.PREFILL
    streams = True

    def counts(
        self, scores: list[torch.Tensor], contexts: list[LayerContext], num_layers: int, options
    ) -> list[torch.Tensor]:
        """Per layer (B, H_kv) long counts of the ``len(scores)`` layers scored so far (list of
        (B, H_kv, n)) of a model of ``num_layers``; final when every layer is scored."""
        raise NotImplementedError

    def head_budgets(self, scores: torch.Tensor, ctx: LayerContext, options) -> torch.Tensor:
        raise RuntimeError(f"the {self.name} allocation needs every layer's scores (model_head_budgets)")

    def model_head_budgets(
        self, scores: list[torch.Tensor], contexts: list[LayerContext], options
    ) -> list[torch.Tensor]:
        return self.counts(scores, contexts, len(scores), options)

    def prefix_head_budgets(
        self, scores: list[torch.Tensor], contexts: list[LayerContext], num_layers: int, options
    ) -> list[torch.Tensor]:
        return self.counts(scores, contexts, num_layers, options)


class LayerAllocation(CrossLayerAllocation):
    name = "layer"
    summary = "one top-k over all layers and heads decides each layer's and head's count (arXiv 2510.13334)"

    def counts(self, scores, contexts, num_layers, options: None) -> list[torch.Tensor]:
        return layer_head_budgets(scores, contexts[0].row_budget, num_layers)
