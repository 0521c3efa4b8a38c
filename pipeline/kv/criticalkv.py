"""CriticalKV (arXiv 2502.03805): projected value norms and the two-stage selection.

Removing entry i from a head's cache perturbs that head's contribution to the attention output
by roughly A_i * V_i W_O^h, so the criticality of an entry is ``(s_i + eps) * m_i`` with

    m_i = mean over the G query heads h of the KV head's group of || V_i W_O^h ||_1

where W_O^h (D x hidden) is the slice of ``o_proj`` that multiplies query head h's output.

Selection per (row, KV head) with budget b_h:
  stage 1 keeps the top ``max(floor(alpha * b_h), window)`` entries by base score s (window
  included, as it scores +inf); stage 2 fills the remaining ``b_h - b1`` slots with the top
  entries by ``(s_i + eps) * m_i`` among those not chosen in stage 1.

Exact L1 at lower cost. Computing m_i for every entry costs 2 n D hidden H_q FLOPs per layer.
Only stage-2 candidates need it, and only those that can reach stage 2's top k. We use the bound

    m_i = mean_h ||V_i W_h||_1 <= sqrt(hidden) * mean_h ||V_i W_h||_2
        <= sqrt(hidden) * sqrt(V_i M V_i^T),   M = mean_h W_h W_h^T   (Jensen)

which costs one D x D quadratic form per entry and KV head (G * hidden / D times cheaper than
the exact norm; within ~1.3x of it on SmolLM2). Candidates are visited in decreasing order of
``(s_i + eps) * bound_i``; exact norms are computed for the first ~1.25 k of them, then for any
remaining candidate whose bound still reaches the k-th best exact criticality. The result equals
the exact top-k (threshold algorithm); on SmolLM2 about 2 k exact norms are computed instead of
n. The ``l2`` norm option uses the per-head Gram form directly (exact, cheap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .budgets import _rank_desc

_CHUNK = 4096  # entries per exact-norm matmul chunk: bounds the (chunk x G*hidden) temporary


@dataclass
class OutputProjection:
    """Per-layer W_O slices grouped by KV head, cached in float32.

    ``per_kv``: (H_kv, D, G * hidden) so that ``V @ per_kv[k]`` gives every query head's
    projection side by side; ``gram``: (H_kv, G, D, D) with ``W_O^h W_O^h^T``.
    """

    per_kv: torch.Tensor
    gram: torch.Tensor
    mean_gram: torch.Tensor
    hidden: int
    groups: int

    @classmethod
    def from_weight(cls, o_weight: torch.Tensor, num_kv_heads: int, head_dim: int) -> "OutputProjection":
        hidden, in_features = o_weight.shape
        num_q = in_features // head_dim
        groups = num_q // num_kv_heads
        w = o_weight.detach().float().view(hidden, num_kv_heads, groups, head_dim)  # W^T blocks
        per_head = w.permute(1, 2, 3, 0)  # (H_kv, G, D, hidden) = W_O^h
        per_kv = per_head.permute(0, 2, 1, 3).reshape(num_kv_heads, head_dim, groups * hidden).contiguous()
        gram = torch.matmul(per_head, per_head.transpose(-1, -2)).contiguous()  # (H_kv, G, D, D)
        return cls(per_kv=per_kv, gram=gram, mean_gram=gram.mean(1).contiguous(), hidden=hidden, groups=groups)


@dataclass
class NormStats:
    """How many exact L1 norms were computed vs how many candidates existed (for benchmarks)."""

    candidates: int = 0
    exact: int = 0
    extra: dict = field(default_factory=dict)


def exact_l1_norms(values: torch.Tensor, proj: OutputProjection, kv_head: int) -> torch.Tensor:
    """m_i for entries of one KV head. values: (m, D) -> (m,) float32, chunked."""
    out = torch.empty(values.shape[0], dtype=torch.float32, device=values.device)
    w = proj.per_kv[kv_head]
    for begin in range(0, values.shape[0], _CHUNK):
        chunk = values[begin : begin + _CHUNK].float()
        projected = torch.matmul(chunk, w).abs_()  # (c, G*hidden)
        out[begin : begin + _CHUNK] = projected.view(-1, proj.groups, proj.hidden).sum(-1).mean(-1)
    return out


def l2_norms(value: torch.Tensor, proj: OutputProjection) -> torch.Tensor:
    """mean_h ||V_i W_O^h||_2 for all entries. value: (B, H_kv, n, D) -> (B, H_kv, n) float32."""
    v = value.float()
    vg = torch.einsum("bknd,kgde->bkgne", v, proj.gram)  # (B, H_kv, G, n, D)
    sq = (vg * v[:, :, None]).sum(-1).clamp(min=0)
    return sq.sqrt().mean(2)


def l1_upper_bounds(value: torch.Tensor, proj: OutputProjection) -> torch.Tensor:
    """Upper bound of the L1 projected norm (see module docstring). (B, H_kv, n, D) -> (B, H_kv, n)."""
    v = value.float()
    quad = (torch.matmul(v, proj.mean_gram[None]) * v).sum(-1).clamp(min=0)
    return quad.sqrt() * (math.sqrt(proj.hidden) * (1.0 + 1e-4)) + 1e-6


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


def norms_for_mask(value: torch.Tensor, proj: OutputProjection, mask: torch.Tensor, out: torch.Tensor) -> int:
    """Fill ``out[mask]`` with exact L1 norms. value: (B, H_kv, n, D); mask/out: (B, H_kv, n)."""
    count = 0
    for k in range(value.shape[1]):
        sel = mask[:, k]
        if not bool(sel.any()):
            continue
        vals = value[:, k][sel]  # (m, D)
        out[:, k][sel] = exact_l1_norms(vals, proj, k)
        count += vals.shape[0]
    return count


def _kth_largest(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """values: (..., n); k: (...) >= 1 -> the k-th largest along the last dim."""
    kmax = max(1, min(int(k.max()), values.shape[-1]))
    ordered = torch.topk(values, kmax, dim=-1, sorted=True).values
    idx = (k - 1).clamp(min=0, max=kmax - 1)
    return ordered.gather(-1, idx[..., None]).squeeze(-1)


def criticality_topk(
    scores: torch.Tensor,
    value: torch.Tensor,
    proj: OutputProjection,
    candidates: torch.Tensor,
    k: torch.Tensor,
    epsilon: float,
    norm: str,
    stats: NormStats | None = None,
    margin: float = 1.25,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: per (row, head) pick the top ``k`` candidates by ``(s + eps) * m``.

    scores: (B, H, n) finite on candidates; value: (B, H, n, D); candidates: (B, H, n) bool;
    k: (B, H) long. Returns (chosen (B, H, n) bool, norms (B, H, n) float32 with NaN where m was
    not computed).
    """
    weight = scores.float().clamp(min=0) + epsilon
    norms = torch.full(scores.shape, float("nan"), dtype=torch.float32, device=scores.device)
    neg_inf = torch.tensor(float("-inf"), device=scores.device)
    if norm == "l2":
        norms = l2_norms(value, proj)
        crit = torch.where(candidates, weight * norms, neg_inf)
        if stats is not None:
            stats.candidates += int(candidates.sum())
        return topk_mask(crit, k) & candidates, norms

    need = candidates & (k[..., None] > 0)
    bound = torch.where(need, weight * l1_upper_bounds(value, proj), neg_inf)
    first = topk_mask(bound, torch.ceil(k.double() * margin).long() + 8) & need
    computed = norms_for_mask(value, proj, first, norms)
    crit = torch.where(first, weight * norms.nan_to_num(0.0), neg_inf)
    threshold = _kth_largest(crit, k)  # (B, H)
    second = need & ~first & (bound >= threshold[..., None])
    if bool(second.any()):
        computed += norms_for_mask(value, proj, second, norms)
        crit = torch.where(first | second, weight * norms.nan_to_num(0.0), neg_inf)
    if stats is not None:
        stats.candidates += int(need.sum())
        stats.exact += computed
    return topk_mask(crit, k) & need, norms


def two_stage_select(
    scores: torch.Tensor,
    head_budget: torch.Tensor,
    row_window: torch.Tensor,
    value: torch.Tensor,
    proj: OutputProjection,
    first_stage_ratio: float,
    epsilon: float,
    norm: str,
    stats: NormStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CriticalKV selection for one layer.

    scores: (B, H, n) base scores (+inf window, -inf padding); head_budget: (B, H) long;
    row_window: (B,) long; value: (B, H, n, D). Returns (keep (B, H, n) bool, norms (B, H, n)).
    Exactly ``head_budget`` entries are kept per (row, head) (fewer only if the row is shorter).
    """
    stage1_count = torch.floor(head_budget.double() * first_stage_ratio).long()
    stage1_count = torch.minimum(torch.maximum(stage1_count, row_window[:, None]), head_budget)
    rank = _rank_desc(scores)
    valid = torch.isfinite(scores) | (scores == float("inf"))
    stage1 = (rank < stage1_count[..., None]) & valid
    candidates = valid & ~stage1
    k2 = head_budget - stage1.sum(-1)
    finite_scores = torch.where(candidates, scores, torch.zeros_like(scores))
    stage2, norms = criticality_topk(finite_scores, value, proj, candidates, k2, epsilon, norm, stats)
    return stage1 | stage2, norms


def topk_select(scores: torch.Tensor, head_budget: torch.Tensor) -> torch.Tensor:
    """Plain selection: the top ``head_budget`` entries by base score. Returns (B, H, n) bool."""
    valid = scores > float("-inf")
    return (_rank_desc(scores) < head_budget[..., None]) & valid
