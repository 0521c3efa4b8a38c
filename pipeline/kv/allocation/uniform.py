"""Uniform allocation: every KV head of row b keeps the row budget b."""

from __future__ import annotations

import torch

from ..parts import Allocation, LayerContext


def uniform_head_budgets(row_budget: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, H) with every head of row b keeping ``row_budget[b]``."""
    return row_budget[:, None].expand(-1, num_heads).clone()


class Uniform(Allocation):
    name = "uniform"
    summary = "every KV head keeps b"

    def head_budgets(self, scores: torch.Tensor, ctx: LayerContext, options: None) -> torch.Tensor:
        return uniform_head_budgets(ctx.row_budget, scores.shape[1])
