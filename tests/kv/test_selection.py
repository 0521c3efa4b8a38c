"""Vectorised scorers, norms, budgets and selection vs the naive references, on random tensors."""

import math

import pytest
import torch

from pipeline.kv.allocation import row_budgets
from pipeline.kv.allocation.adakv import adakv_head_budgets
from pipeline.kv.allocation.headkv import headkv_head_budgets
from pipeline.kv.scorers.snapkv import snapkv_scores
from pipeline.kv.scorers.streamingllm import streamingllm_scores
from pipeline.kv.selection.criticalkv import two_stage_select
from pipeline.kv.value_norms import NormStats, OutputProjection, entry_norms, l2_norms, norms_for_mask

from .reference import (
    adakv_reference,
    snapkv_reference,
    two_stage_reference,
    value_norm_reference,
)


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("h_q,h_kv", [(4, 2), (3, 3), (6, 1)])
@pytest.mark.parametrize("pooling,kernel", [("avg", 5), ("max", 7), ("avg", 1)])
def test_snapkv_scores_match_reference(h_q, h_kv, pooling, kernel):
    n, d, w = 40, 8, 6
    q, k = _rand(1, h_q, n, d, seed=1) * 2, _rand(1, h_kv, n, d, seed=2) * 2
    pos = torch.arange(n)[None]
    got = snapkv_scores(q, k, pos, torch.tensor([w]), kernel, pooling, d**-0.5)
    ref = snapkv_reference(q[0], k[0], n, w, kernel, pooling, d**-0.5)
    for h in range(h_kv):
        for j in range(n):
            if math.isinf(ref[h][j]):
                assert math.isinf(float(got[0, h, j]))
            else:
                assert float(got[0, h, j]) == pytest.approx(ref[h][j], rel=1e-4, abs=1e-6)


def test_snapkv_left_padding_equals_unpadded_row():
    n, pad, d = 30, 7, 8
    q, k = _rand(1, 4, n, d, seed=3), _rand(1, 2, n, d, seed=4)
    zeros_q, zeros_k = torch.zeros(1, 4, pad, d), torch.zeros(1, 2, pad, d)
    qp, kp = torch.cat([zeros_q, q], 2), torch.cat([zeros_k, k], 2)
    pos = torch.cat([torch.full((pad,), -1), torch.arange(n)])[None]
    alone = snapkv_scores(q, k, torch.arange(n)[None], torch.tensor([5]), 5, "avg", 0.3)
    padded = snapkv_scores(qp, kp, pos, torch.tensor([5]), 5, "avg", 0.3)
    assert torch.isneginf(padded[..., :pad]).all()
    torch.testing.assert_close(padded[..., pad:], alone)


@pytest.mark.parametrize("groups,p", [(2, 1), (3, 1), (1, 1), (2, 2)])
def test_projected_value_norms_match_reference(groups, p):
    h_kv, n, d, hidden = 2, 25, 8, 20
    value = _rand(1, h_kv, n, d, seed=5)
    o_weight = _rand(hidden, h_kv * groups * d, seed=6)
    proj = OutputProjection.from_weight(o_weight, h_kv, d)
    if p == 1:
        got = torch.full((1, h_kv, n), float("nan"))
        norms_for_mask(value, proj, torch.ones(1, h_kv, n, dtype=torch.bool), got)
    else:
        got = l2_norms(value, proj)
    for k in range(h_kv):
        ref = value_norm_reference(value[0, k], o_weight, k, groups, d, p=p)
        torch.testing.assert_close(got[0, k].double(), torch.tensor(ref, dtype=torch.double), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget,alpha,eps", [(12, 0.5, 1e-4), (20, 0.3, 0.0), (9, 0.0, 1e-4), (30, 1.0, 1e-4)])
@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_two_stage_selection_matches_reference(budget, alpha, eps, norm):
    h_kv, groups, n, d, hidden, w = 3, 2, 60, 8, 24, 4
    torch.manual_seed(7)
    scores = torch.rand(1, h_kv, n) ** 4  # peaked, like attention
    scores[..., n - w :] = float("inf")
    value = torch.randn(1, h_kv, n, d) * torch.rand(1, h_kv, n, 1) * 3
    o_weight = torch.randn(hidden, h_kv * groups * d)
    proj = OutputProjection.from_weight(o_weight, h_kv, d)
    head_budget = torch.full((1, h_kv), budget)
    stats = NormStats()
    keep, _ = two_stage_select(scores, head_budget, torch.tensor([w]), value, proj, alpha, eps, norm, stats)
    for k in range(h_kv):
        norms = value_norm_reference(value[0, k], o_weight, k, groups, d, p=1 if norm == "l1" else 2)
        ref = two_stage_reference(scores[0, k].tolist(), norms, budget, w, alpha, eps)
        assert keep[0, k].nonzero().flatten().tolist() == ref
        assert int(keep[0, k].sum()) == budget
    if norm == "l1" and alpha < 1.0:
        assert stats.exact < stats.candidates  # pruning skipped entries that could not be selected


def test_two_stage_selection_builds_the_projection_only_when_a_norm_is_missing():
    """A streamed shrink hands every norm in: the layer's W_O slices are then not built (they are
    cached for the latest layer only), and the kept entries are those of the eager call."""
    h_kv, n, d, hidden, w = 2, 40, 8, 16, 3
    torch.manual_seed(5)
    scores = torch.rand(1, h_kv, n) ** 3
    scores[..., n - w :] = float("inf")
    value = torch.randn(1, h_kv, n, d)
    proj = OutputProjection.from_weight(torch.randn(hidden, h_kv * d), h_kv, d)
    budget, window = torch.full((1, h_kv), 12), torch.tensor([w])
    want, _ = two_stage_select(scores, budget, window, value, proj, 0.5, 1e-4, "l1")
    known = entry_norms(value, proj, "l1")
    calls = []

    def build():
        calls.append(1)
        return proj

    keep, _ = two_stage_select(scores, budget, window, value, build, 0.5, 1e-4, "l1", known=known)
    assert torch.equal(keep, want) and calls == []
    keep, _ = two_stage_select(scores, budget, window, value, build, 0.5, 1e-4, "l1")
    assert torch.equal(keep, want) and calls == [1]


def test_criticalkv_keeps_stage1_and_budget():
    torch.manual_seed(8)
    scores = torch.rand(2, 2, 50)
    scores[..., -3:] = float("inf")
    value = torch.randn(2, 2, 50, 4)
    proj = OutputProjection.from_weight(torch.randn(12, 2 * 4), 2, 4)
    budgets = torch.tensor([[10, 17], [25, 5]])
    keep, _ = two_stage_select(scores, budgets, torch.tensor([3, 3]), value, proj, 0.5, 1e-4, "l1")
    assert keep.sum(-1).tolist() == budgets.tolist()
    for b in range(2):
        for h in range(2):
            b1 = max(int(budgets[b, h]) // 2, 3)
            top = torch.argsort(scores[b, h], descending=True)[:b1]
            assert keep[b, h, top].all()


def test_adakv_budgets_match_reference_and_floor():
    torch.manual_seed(9)
    h, n = 4, 80
    scores = torch.rand(1, h, n) ** 3
    scores[0, 0] *= 10  # one head dominates
    scores[..., -4:] = float("inf")
    for budget, alpha in [(20, 0.2), (10, 0.5), (40, 0.0)]:
        got = adakv_head_budgets(scores, torch.tensor([budget]), alpha)
        assert got.sum().item() == h * budget
        assert (got >= math.floor(alpha * budget)).all()
        assert got[0].tolist() == adakv_reference(scores[0].tolist(), budget, alpha)
    assert adakv_head_budgets(scores, torch.tensor([20]), 0.2)[0, 0] > 20  # adaptivity is real


def test_headkv_budgets_follow_priors():
    priors = torch.tensor([[1.0, 3.0], [0.0, 4.0]])  # (L, H)
    args = (torch.tensor([100]), torch.tensor([4]), torch.tensor([1000]), 0.2)
    # weights 0.2 + 0.8 * 4 * p / 8 -> [[0.6, 1.4], [0.2, 1.8]]; no head saturates at n = 1000
    assert headkv_head_budgets(priors, 0, *args).tolist() == [[60, 140]]
    assert headkv_head_budgets(priors, 1, *args).tolist() == [[20, 180]]


def test_headkv_redistributes_what_saturated_heads_cannot_use():
    priors = torch.tensor([[0.0, 0.0, 0.0, 10.0], [0.0, 1.0, 0.0, 0.0]])
    n, b = 100, 40
    layers = [
        headkv_head_budgets(priors, layer, torch.tensor([b]), torch.tensor([4]), torch.tensor([n]), 0.2)[0]
        for layer in range(2)
    ]
    budgets = torch.stack(layers)
    assert budgets.max() <= n and budgets[0, 3] == n  # the dominant head keeps its whole context
    assert abs(int(budgets.sum()) - 8 * b) <= 8  # the pool is still used in full (floors aside)
    assert budgets[1, 1] > budgets[0, 0]  # the rest follows the priors


def test_row_budgets_per_row():
    b, w = row_budgets(torch.tensor([100, 10, 1000]), 0.2, None, 32)
    assert b.tolist() == [32, 10, 200] and w.tolist() == [32, 10, 32]  # the window is never cut
    b, w = row_budgets(torch.tensor([100, 10]), 1.0, 50, 32)
    assert b.tolist() == [50, 10]


def test_streamingllm_keeps_sinks_and_recent():
    pos = torch.cat([torch.full((3,), -1), torch.arange(20)])[None]
    s = streamingllm_scores(pos, 2, torch.tensor([4]), sink_tokens=2)
    assert torch.isneginf(s[0, :, :3]).all()
    kept = torch.argsort(s[0, 0], descending=True)[:8].sort().values - 3
    assert kept.tolist() == [0, 1, 14, 15, 16, 17, 18, 19]
