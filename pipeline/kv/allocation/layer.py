"""Cross-layer allocation (Layer-DefensiveKV, Feng et al., arXiv 2510.13334; also KVzip's global
budget, arXiv 2505.23416): one top-k over the base scores of every layer and KV head of a row
(k = L * H_kv * b) decides how many entries each layer and head keeps. The total kept stays
``L * H_kv * b`` per row; observation-window entries score +inf and always win. No floor per layer
or head (as published). Needs every layer's scores, so the dense cache is held until the prefill
ends (peak memory = the full cache, reported per method).
"""

from __future__ import annotations

import torch

from ..parts import Allocation, LayerContext
from ..phases import Phase
from ..ranking import rank_desc


def layer_head_budgets(scores: list[torch.Tensor], row_budget: torch.Tensor) -> list[torch.Tensor]:
    """scores: per layer (B, H, n) base scores (+inf window, -inf padding); row_budget: (B,).

    Returns per layer (B, H) long counts; summed over layers and heads they are ``L * H * row_budget``
    (fewer only when a row has fewer keepable entries). Ties go to the earlier layer, head, position.
    """
    stacked = torch.stack(scores, dim=1)  # (B, L, H, n)
    bsz, layers, heads, n = stacked.shape
    rank = rank_desc(stacked.reshape(bsz, -1)).view(bsz, layers, heads, n)
    chosen = (rank < (row_budget * layers * heads)[:, None, None, None]) & (stacked > float("-inf"))
    counts = chosen.sum(-1)  # (B, L, H)
    return [counts[:, layer] for layer in range(layers)]


class LayerAllocation(Allocation):
    name = "layer"
    decides = Phase.PREFILL
    summary = "one top-k over all layers and heads decides each layer's and head's count (arXiv 2510.13334)"

    def head_budgets(self, scores: torch.Tensor, ctx: LayerContext, options: None) -> torch.Tensor:
        raise RuntimeError("the layer allocation needs every layer's scores (model_head_budgets)")

    def model_head_budgets(
        self, scores: list[torch.Tensor], contexts: list[LayerContext], options: None
    ) -> list[torch.Tensor]:
        return layer_head_budgets(scores, contexts[0].row_budget)
