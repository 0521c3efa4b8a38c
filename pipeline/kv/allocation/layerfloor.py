"""Cross-layer allocation with a per-head floor: the ``layer`` allocation's one top-k over every layer
and KV head of a row (Layer-DefensiveKV, Feng et al., arXiv 2510.13334; KVzip's global budget,
arXiv 2505.23416) under AdaKV's safeguard (Feng et al., arXiv 2407.11550): every (layer, head) first
gets ``floor(alpha_safeguard * b)`` of its own best entries (window included), and the rest of the pool
``L * H_kv * b`` goes to the best remaining entries of all layers and heads together. A head whose
scores are low everywhere (a scorer's miscalibrated head) keeps a floor instead of nothing.

It streams like ``layer`` (:mod:`pipeline.kv.streamed`): a head's guaranteed entries depend on its own
scores only, and the top-k of the rest among the first layers takes at least what it takes of them
among all layers, so the counts from the first layers bound their final counts from above.
"""

from __future__ import annotations

import torch

from ..ranking import topk_mask
from .common import SafeguardOptions
from .layer import CrossLayerAllocation, layer_head_budgets


def guaranteed_first(scores: torch.Tensor, row_budget: torch.Tensor, alpha_safeguard: float) -> torch.Tensor:
    """scores: (B, H, n) base scores (+inf window, -inf padding); row_budget: (B,).

    Returns (B, H, n) priorities: of each head's ``floor(alpha_safeguard * b)`` best entries (its +inf
    window among them) the finite ones raised to +inf, the rest unchanged (which of equal scores is
    raised changes no head's count, so ``topk_mask``'s unspecified tie order is safe here)."""
    safe = torch.floor(row_budget.double() * alpha_safeguard).to(torch.long)  # (B,)
    best = topk_mask(scores, safe[:, None].expand(scores.shape[:2]))
    return scores.masked_fill(best & torch.isfinite(scores), float("inf"))


def floored_layer_head_budgets(
    scores: list[torch.Tensor], row_budget: torch.Tensor, alpha_safeguard: float, num_layers: int | None = None
) -> list[torch.Tensor]:
    """scores: per layer (B, H, n); row_budget: (B,); num_layers: the model's layers when ``scores``
    holds only the first of them. Returns per layer (B, H) long counts, each at least the head's floor
    (fewer only where the head has fewer keepable entries), summing to ``num_layers * H * b`` per row."""
    priorities = [guaranteed_first(s, row_budget, alpha_safeguard) for s in scores]
    return layer_head_budgets(priorities, row_budget, num_layers)


class LayerFloorAllocation(CrossLayerAllocation):
    name = "layerfloor"
    options = SafeguardOptions
    summary = "one top-k over all layers and heads, each head floored at alpha_safeguard * b (arXiv 2407.11550)"

    def counts(self, scores, contexts, num_layers, options: SafeguardOptions) -> list[torch.Tensor]:
        return floored_layer_head_budgets(scores, contexts[0].row_budget, options.alpha_safeguard, num_layers)
