"""Plain selection: the top ``b_h`` entries of each head by base score (ties: earlier position)."""

from __future__ import annotations

import torch

from ..parts import LayerContext, Selection
from ..ranking import rank_desc


def topk_select(scores: torch.Tensor, head_budget: torch.Tensor) -> torch.Tensor:
    """scores: (B, H, n) (+inf window, -inf padding); head_budget: (B, H) -> keep (B, H, n) bool."""
    valid = scores > float("-inf")
    return (rank_desc(scores) < head_budget[..., None]) & valid


class TopK(Selection):
    name = "topk"
    summary = "top entries by base score"
    nested = True  # the top b' of the top b are the top b'

    def select(self, scores, head_budget, ctx: LayerContext, options: None, stats):
        return topk_select(scores, head_budget), None
