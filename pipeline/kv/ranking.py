"""Ranking helpers shared by the allocations, the selections and the decode-time cap.

All work along the last dimension and are vectorised over the leading ones (rows, heads).
"""

from __future__ import annotations

import torch


def rank_desc(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each element along the last dim in descending order (0 = largest; ties: lower index
    first, so a selection by rank is deterministic). (..., n) -> (..., n) long."""
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return rank


def topk_mask(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(..., n) bool marking the ``k[...]`` largest values per row (k varies per row).

    Uses ``torch.topk``: tie order is unspecified, so use it only where ties cannot change the
    result (values derived from continuous norms) or do not matter.
    """
    kmax = min(int(k.max()) if k.numel() else 0, values.shape[-1])
    mask = torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    if kmax <= 0:
        return mask
    idx = torch.topk(values, kmax, dim=-1, sorted=True).indices
    take = torch.arange(kmax, device=values.device) < k[..., None]
    return mask.scatter_(-1, idx, take)


def kth_largest(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """values: (..., n); k: (...) >= 1 -> the k-th largest along the last dim."""
    kmax = max(1, min(int(k.max()), values.shape[-1]))
    ordered = torch.topk(values, kmax, dim=-1, sorted=True).values
    idx = (k - 1).clamp(min=0, max=kmax - 1)
    return ordered.gather(-1, idx[..., None]).squeeze(-1)
