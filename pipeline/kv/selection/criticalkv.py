"""CriticalKV (arXiv 2502.03805): keep the entries whose removal would perturb the output most.

Removing entry i from a head's cache perturbs that head's contribution to the attention output by
roughly A_i * V_i W_O^h, so the criticality of an entry is ``(s_i + eps) * m_i`` with m_i the
projected value norm (:mod:`pipeline.kv.value_norms`).

Selection per (row, KV head) with budget b_h: stage 1 keeps the top ``max(floor(alpha * b_h),
window)`` entries by base score s (window included, as it scores +inf); stage 2 fills the remaining
``b_h - b1`` slots with the top entries by ``(s_i + eps) * m_i`` among those not chosen in stage 1.
alpha is the paper's 0.5, except where the base scores already weigh ``||W_O v_i||`` (KVzap's predicted
KVzip+ scores), whose default is :data:`VALUE_WEIGHTED_FIRST_STAGE_RATIO`: stage 2 would weigh the value
norm a second time (measured: docs/results/criticalkv-stage-ratio/README.md).

Exact L1 at lower cost: only stage-2 candidates that can reach stage 2's top k need m_i.
Where every candidate's norm is already known (``known``, e.g. a layer shrinking to a smaller count,
:mod:`pipeline.kv.prefill.streamed_budgets`) the top k is taken from them directly. Otherwise candidates are visited
in decreasing order of ``(s_i + eps) * bound_i`` (the Jensen bound of
:func:`~pipeline.kv.value_norms.l1_upper_bounds`); exact norms are computed for the first ~1.25 k of
them, then for any remaining candidate whose bound still reaches the k-th best exact criticality.
The result equals the exact top-k (threshold algorithm); on SmolLM2 about 2 k exact norms are
computed instead of n. The ``l2`` norm uses the per-head Gram form directly (exact, cheap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, Field

from ..parts import LayerContext, Selection
from ..ranking import kth_largest, rank_desc, topk_mask
from ..value_norms import NormStats, OutputProjection, l1_upper_bounds, l2_norms, norms_for_mask

#: the paper's stage-1 ratio (arXiv 2502.03805; kvpress ``CriticalKVPress``)
PAPER_FIRST_STAGE_RATIO = 0.5
#: the stage-1 ratio where the base scores already weigh ||W_O v_i|| (``Scorer.weighs_by_value_norm``):
#: stage 2 would weigh the value norm a second time; chosen by the sweeps of
#: docs/results/criticalkv-stage-ratio/README.md
VALUE_WEIGHTED_FIRST_STAGE_RATIO = 0.75


class CriticalKVOptions(BaseModel):
    """CriticalKV selection"""

    first_stage_ratio: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="stage 1 keeps this fraction of b_h by score",
        json_schema_extra={
            "shown_default": f"{VALUE_WEIGHTED_FIRST_STAGE_RATIO} where the scores already weigh the value norm "
            f"(kvzap), else the paper's {PAPER_FIRST_STAGE_RATIO}"
        },
    )
    epsilon: float = Field(1e-4, ge=0.0, description="added to the score before it multiplies the value norm")
    norm: Literal["l1", "l2"] = Field("l1", description="norm of the projected value V_i W_O^h")


def stage1_ratio(options: CriticalKVOptions, scorer_weighs_values: bool) -> float:
    """The stage-1 ratio: the option's value, else the default for the scorer's kind of scores."""
    if options.first_stage_ratio is not None:
        return options.first_stage_ratio
    return VALUE_WEIGHTED_FIRST_STAGE_RATIO if scorer_weighs_values else PAPER_FIRST_STAGE_RATIO


def criticality_topk(
    scores: torch.Tensor,
    value: torch.Tensor,
    proj: OutputProjection | Callable[[], OutputProjection],
    candidates: torch.Tensor,
    k: torch.Tensor,
    epsilon: float,
    norm: str,
    stats: NormStats | None = None,
    margin: float = 1.25,
    known: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: per (row, head) pick the top ``k`` candidates by ``(s + eps) * m``.

    scores: (B, H, n) finite on candidates; value: (B, H, n, D); candidates: (B, H, n) bool;
    k: (B, H) long; known: (B, H, n) L1 norms already computed (NaN where not), not computed again;
    proj: the layer's W_O slices, or a callable giving them, called only when a norm must be computed
    (a shrink whose every norm is known needs none, :mod:`pipeline.kv.prefill.streamed_budgets`).
    Returns (chosen (B, H, n) bool, norms (B, H, n) float32, NaN where m was not computed). Ties go
    to the earlier position (deterministic, the same at any padding).
    """
    stats = stats if stats is not None else NormStats()
    weight = scores.float().clamp(min=0) + epsilon
    if known is not None and norm == "l1":
        norms = known.float().clone()
    else:
        norms = torch.full(scores.shape, float("nan"), dtype=torch.float32, device=scores.device)
    neg_inf = torch.tensor(float("-inf"), device=scores.device)
    t0 = time.perf_counter()
    if norm == "l2":
        norms = l2_norms(value, resolve(proj))
        stats.exact_s += time.perf_counter() - t0
        stats.candidates += int(candidates.sum())
        crit = torch.where(candidates, weight * norms, neg_inf)
        return (rank_desc(crit) < k[..., None]) & candidates, norms

    need = candidates & (k[..., None] > 0)
    if known is not None and not bool(torch.isnan(norms[need]).any()):  # every candidate's norm known
        crit = torch.where(need, weight * norms.nan_to_num(0.0), neg_inf)
        return (rank_desc(crit) < k[..., None]) & need, norms
    proj = resolve(proj)
    bound = torch.where(need, weight * l1_upper_bounds(value, proj), neg_inf)
    first = topk_mask(bound, torch.ceil(k.double() * margin).long() + 8) & need
    t1 = time.perf_counter()
    computed = norms_for_mask(value, proj, first & torch.isnan(norms), norms)
    crit = torch.where(first, weight * norms.nan_to_num(0.0), neg_inf)
    threshold = kth_largest(crit, k)  # (B, H)
    second = need & ~first & (bound >= threshold[..., None])
    if bool(second.any()):
        computed += norms_for_mask(value, proj, second & torch.isnan(norms), norms)
        crit = torch.where(first | second, weight * norms.nan_to_num(0.0), neg_inf)
    stats.bound_s += t1 - t0
    stats.exact_s += time.perf_counter() - t1
    stats.candidates += int(need.sum())
    stats.exact += computed
    # ties (equal tokens have equal norms) go to the earlier position, as in every other selection
    return (rank_desc(crit) < k[..., None]) & need, norms


def resolve(proj: OutputProjection | Callable[[], OutputProjection]) -> OutputProjection:
    """The projection itself, from itself or from the callable that builds it."""
    return proj if isinstance(proj, OutputProjection) else proj()


def two_stage_select(
    scores: torch.Tensor,
    head_budget: torch.Tensor,
    row_window: torch.Tensor,
    value: torch.Tensor,
    proj: OutputProjection | Callable[[], OutputProjection],
    first_stage_ratio: float,
    epsilon: float,
    norm: str,
    stats: NormStats | None = None,
    known: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CriticalKV selection for one layer (``known``: norms already computed, see :func:`criticality_topk`).

    scores: (B, H, n) base scores (+inf window, -inf padding); head_budget: (B, H) long;
    row_window: (B,) long; value: (B, H, n, D). Returns (keep (B, H, n) bool, norms (B, H, n)).
    Exactly ``head_budget`` entries are kept per (row, head) (fewer only if the row is shorter).
    """
    stage1_count = torch.floor(head_budget.double() * first_stage_ratio).long()
    stage1_count = torch.minimum(torch.maximum(stage1_count, row_window[:, None]), head_budget)
    valid = scores > float("-inf")
    stage1 = (rank_desc(scores) < stage1_count[..., None]) & valid
    candidates = valid & ~stage1
    k2 = head_budget - stage1.sum(-1)
    finite_scores = torch.where(candidates, scores, torch.zeros_like(scores))
    stage2, norms = criticality_topk(finite_scores, value, proj, candidates, k2, epsilon, norm, stats, known=known)
    return stage1 | stage2, norms


class CriticalKV(Selection):
    name = "criticalkv"
    options = CriticalKVOptions
    weighs_by_value_norm = True
    # nested: both stages' counts grow with b_h, stage 1 is a top-k by score, and stage 2 ranks each entry
    # by its own (s + eps) * m, so every entry chosen at b' <= b is among those chosen at b
    nested = True
    summary = "two-stage selection by (s + eps) * ||V W_O|| (arXiv 2502.03805)"

    def select(self, scores, head_budget, ctx: LayerContext, options: CriticalKVOptions, stats):
        return two_stage_select(
            scores,
            head_budget,
            ctx.row_window,
            ctx.value,
            ctx.projection,  # built only if a norm must be computed
            stage1_ratio(options, ctx.scorer_weighs_values),
            options.epsilon,
            options.norm,
            stats,
            ctx.known_norms,
        )
