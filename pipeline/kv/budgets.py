"""How many entries each (row, KV head) keeps.

* Row budget ``b`` (per KV head): ``round(cache_size * n_b)`` of row b's own real length, or an
  absolute ``budget`` in tokens, clamped to the row length. The observation window shrinks to
  ``min(window, b)`` for rows whose budget is smaller than the window.
* Uniform: every head keeps ``b``.
* AdaKV (Feng et al., arXiv 2407.11550): a layer-wide top-k over the base scores of all heads
  (k = H_kv * b) decides each head's count; a safeguard gives every head at least
  ``floor(alpha_safeguard * b)`` of its own best entries.
* HeadKV (Fu et al., arXiv 2410.19258): static budgets from per-head importance priors shared
  across all layers: head (l, h) gets weight ``w_lh = alpha + (1 - alpha) * L * H * p_lh / sum(p)``
  (a floor of ``alpha * b`` plus a share of the pool proportional to its prior; weights average
  1) and the row's whole pool ``L * H * b`` is split as ``min(n_b, c * w_lh)`` with ``c`` chosen by
  water-filling, so the budget a saturated head cannot use (it already keeps its whole context) goes
  to the others and the total kept stays ``L * H * b``; then rounded down and raised to the window.

CriticalKV never changes these counts, only which entries fill them.
"""

from __future__ import annotations

import torch


def row_budgets(
    lengths: torch.Tensor, cache_size: float, budget: int | None, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (budget, window), both (B,) long.

    lengths: (B,) real (unpadded) token counts of each row.
    """
    lengths = lengths.to(torch.long)
    if budget is not None:
        b = torch.full_like(lengths, int(budget))
    else:
        b = torch.round(lengths.double() * cache_size).to(torch.long)
    b = torch.minimum(b.clamp(min=1), lengths.clamp(min=1))
    w = torch.minimum(torch.full_like(lengths, int(window)), b)
    return b, w


def uniform_head_budgets(row_budget: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, H) with every head of row b keeping ``row_budget[b]``."""
    return row_budget[:, None].expand(-1, num_heads).clone()


def _rank_desc(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each element along the last dim in descending order (0 = largest)."""
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return rank


def adakv_head_budgets(scores: torch.Tensor, row_budget: torch.Tensor, alpha_safeguard: float) -> torch.Tensor:
    """AdaKV allocation.

    scores: (B, H, n) base scores (+inf window, -inf padding); row_budget: (B,).
    Returns (B, H) long, summing to ``H * row_budget[b]`` over each row.
    """
    bsz, heads, n = scores.shape
    safe = torch.floor(row_budget.double() * alpha_safeguard).to(torch.long)  # (B,)
    priority = scores.clone()
    guaranteed = _rank_desc(scores) < safe[:, None, None]
    priority = priority.masked_fill(guaranteed & torch.isfinite(scores), float("inf"))
    flat_rank = _rank_desc(priority.reshape(bsz, heads * n)).view(bsz, heads, n)
    chosen = flat_rank < (row_budget * heads)[:, None, None]
    return chosen.sum(-1)


def headkv_head_budgets(
    priors: torch.Tensor,
    layer_idx: int,
    row_budget: torch.Tensor,
    row_window: torch.Tensor,
    lengths: torch.Tensor,
    alpha_safeguard: float,
) -> torch.Tensor:
    """HeadKV static allocation for one layer.

    priors: (L, H) non-negative per-KV-head importance for all layers; returns (B, H) long.
    """
    priors = priors.double().clamp(min=0)
    num_layers, heads = priors.shape
    total = priors.sum()
    share = priors * (num_layers * heads) / total if total > 0 else torch.ones_like(priors)
    weight = (alpha_safeguard + (1.0 - alpha_safeguard) * share).reshape(-1)  # (L*H,)
    out = []
    for b, n, w in zip(row_budget.tolist(), lengths.tolist(), row_window.tolist()):
        alloc = _water_fill(weight, float(b) * weight.numel(), float(n))
        layer = torch.floor(alloc.view(num_layers, heads)[layer_idx] + 1e-9).long()
        out.append(layer.clamp(min=w, max=n))
    return torch.stack(out).to(row_budget.device)


def _water_fill(weight: torch.Tensor, total: float, cap: float) -> torch.Tensor:
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
