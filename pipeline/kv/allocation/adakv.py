"""AdaKV (Feng et al., arXiv 2407.11550): a layer-wide top-k over the base scores of all heads
(k = H_kv * b) decides each head's count; a safeguard gives every head at least
``floor(alpha_safeguard * b)`` of its own best entries. The counts sum to ``H_kv * b`` per row."""

from __future__ import annotations

import torch

from ..parts import Allocation, LayerContext
from ..ranking import rank_desc
from .common import SafeguardOptions


def adakv_head_budgets(scores: torch.Tensor, row_budget: torch.Tensor, alpha_safeguard: float) -> torch.Tensor:
    """scores: (B, H, n) base scores (+inf window, -inf padding); row_budget: (B,) -> (B, H) long."""
    bsz, heads, n = scores.shape
    safe = torch.floor(row_budget.double() * alpha_safeguard).to(torch.long)  # (B,)
    guaranteed = rank_desc(scores) < safe[:, None, None]
    priority = scores.masked_fill(guaranteed & torch.isfinite(scores), float("inf"))
    flat_rank = rank_desc(priority.reshape(bsz, heads * n)).view(bsz, heads, n)
    chosen = flat_rank < (row_budget * heads)[:, None, None]
    return chosen.sum(-1)


class AdaKV(Allocation):
    name = "adakv"
    options = SafeguardOptions
    summary = "layer-wide top-k decides each head's count, with a safeguard floor (arXiv 2407.11550)"

    def head_budgets(self, scores: torch.Tensor, ctx: LayerContext, options: SafeguardOptions) -> torch.Tensor:
        return adakv_head_budgets(scores, ctx.row_budget, options.alpha_safeguard)
