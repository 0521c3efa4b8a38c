"""HeadKV (Fu et al., arXiv 2410.19258): static per-head budgets from importance priors.

Priors are per (layer, KV head) and shared across all layers: head (l, h) gets weight
``w_lh = alpha + (1 - alpha) * L * H * p_lh / sum(p)`` (a floor of ``alpha * b`` plus a share of the
pool proportional to its prior; weights average 1) and the row's whole pool ``L * H * b`` is split
as ``min(n_b, c * w_lh)`` with ``c`` chosen by water-filling, so the budget a saturated head cannot
use (it already keeps its whole context) goes to the others and the total kept stays ``L * H * b``;
then rounded down and raised to the window. The priors file is read by the engine
(:mod:`pipeline.engine.priors`); this module only sees the (L, H_kv) tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field

from ..parts import Allocation, LayerContext
from .common import SafeguardOptions


class HeadKVOptions(SafeguardOptions):
    """HeadKV allocation"""

    head_priors: Path | None = Field(
        None, description="HeadKV per-head importance JSON (default: the calibration shipped for the model)"
    )


def headkv_head_budgets(
    priors: torch.Tensor,
    layer_idx: int,
    row_budget: torch.Tensor,
    row_window: torch.Tensor,
    lengths: torch.Tensor,
    alpha_safeguard: float,
) -> torch.Tensor:
    """HeadKV static allocation for one layer. priors: (L, H) non-negative -> (B, H) long."""
    priors = priors.double().clamp(min=0)
    num_layers, heads = priors.shape
    total = priors.sum()
    share = priors * (num_layers * heads) / total if total > 0 else torch.ones_like(priors)
    weight = (alpha_safeguard + (1.0 - alpha_safeguard) * share).reshape(-1)  # (L*H,)
    out = []
    for b, n, w in zip(row_budget.tolist(), lengths.tolist(), row_window.tolist()):
        alloc = water_fill(weight, float(b) * weight.numel(), float(n))
        layer = torch.floor(alloc.view(num_layers, heads)[layer_idx] + 1e-9).long()
        out.append(layer.clamp(min=w, max=n))
    return torch.stack(out).to(row_budget.device)


def water_fill(weight: torch.Tensor, total: float, cap: float) -> torch.Tensor:
    """x = min(cap, c * weight) with sum(x) = total (or every x = cap if total exceeds that)."""
    saturated = torch.zeros_like(weight, dtype=torch.bool)
    for _ in range(weight.numel() + 1):
        free = weight.masked_fill(saturated, 0.0).sum()
        if free <= 0:
            break
        c = (total - cap * saturated.sum()) / free
        newly = ~saturated & (c * weight > cap)
        if not bool(newly.any()):
            break
        saturated |= newly
    return torch.where(saturated, torch.full_like(weight, cap), c * weight)


class HeadKVAllocation(Allocation):
    name = "headkv"
    options = HeadKVOptions
    summary = "static per-head budgets from retrieval-head priors (arXiv 2410.19258)"
    needs_head_priors = True

    def head_budgets(self, scores: torch.Tensor, ctx: LayerContext, options: HeadKVOptions) -> torch.Tensor:
        if ctx.head_priors is None:
            raise ValueError("allocation 'headkv' needs HeadKV priors (compression.head_priors)")
        return headkv_head_budgets(
            ctx.head_priors, ctx.layer_idx, ctx.row_budget, ctx.row_window, ctx.lengths, options.alpha_safeguard
        )
