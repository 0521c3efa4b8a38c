"""Predictor-aware shares against naive references: brute force on concave curves, and KVzip's
global top-k when the predictor is perfect."""

import itertools

import pytest
import torch

from pipeline.eval.kvzap_shares import envelope_counts, kept_of_global_top, predicted_shares, score_curves
from pipeline.kv.kvzap_model import KVzapModel


def _brute_force(curves: torch.Tensor, pool: int) -> tuple[int, ...]:
    heads, m = curves.shape[0], curves.shape[1] - 1
    best = max(
        (c for c in itertools.product(range(m + 1), repeat=heads) if sum(c) == pool),
        key=lambda c: sum(float(curves[h, k]) for h, k in enumerate(c)),
    )
    return best


@pytest.mark.parametrize("seed", range(6))
def test_envelope_counts_are_the_best_integer_allocation_on_concave_curves(seed):
    g = torch.Generator().manual_seed(seed)
    gains = torch.rand(3, 5, generator=g, dtype=torch.float64).sort(-1, descending=True).values  # concave
    curves = torch.cat([torch.zeros(3, 1, dtype=torch.float64), gains.cumsum(-1)], -1)
    for pool in range(0, 16):
        got = envelope_counts(curves, pool)
        assert got.tolist() == [float(k) for k in _brute_force(curves, pool)], pool


def test_envelope_counts_clamp_the_pool_and_split_it_exactly():
    curves = score_curves(torch.randn(4, 6), torch.randn(4, 6))  # any order: not concave in general
    assert envelope_counts(curves, -3).tolist() == [0.0] * 4
    assert envelope_counts(curves, 99).tolist() == [6.0] * 4
    for pool in (1.0, 7.5, 13.0):
        got = envelope_counts(curves, pool)
        assert abs(float(got.sum()) - pool) < 1e-9 and bool(((got >= 0) & (got <= 6)).all())


def test_score_curves_follow_the_predicted_order():
    log_scores = torch.tensor([[0.0, 1.0, 2.0]]).log()  # true scores 0, 1, 2 (log 0 -> exp 0)
    curves = score_curves(torch.tensor([[3.0, 1.0, 2.0]]), log_scores)
    torch.testing.assert_close(curves, torch.tensor([[0.0, 0.0, 2.0, 3.0]], dtype=torch.float64))


@pytest.mark.parametrize("fixed", [0, 5])
def test_with_a_perfect_predictor_the_shares_are_kvzip_global_top_k(fixed):
    layers, heads, m, tokens = 2, 3, 40, 200
    g = torch.Generator().manual_seed(7)
    log_scores = torch.randn(layers, heads, m, generator=g) * 2
    # a linear predictor that returns its input: hidden = the true log-scores themselves
    weight = torch.eye(heads)[None].repeat(layers, 1, 1)
    model = KVzapModel("linear", {"weight": weight, "bias": torch.zeros(layers, heads)}, torch.ones(1, layers, heads),
                       torch.tensor([0.5]))  # fmt: skip
    hidden = log_scores.transpose(1, 2)  # (L, m, H)
    sizes = [0.1, 0.25, 0.6]
    got = predicted_shares(model, hidden, log_scores, sizes, tokens, fixed)
    for s, size in enumerate(sizes):
        pool = round((size * tokens - fixed) * layers * heads * m / tokens)  # integer for these sizes
        flat = log_scores.reshape(-1)
        kept = torch.zeros_like(flat, dtype=torch.bool)
        kept[flat.topk(pool).indices] = True
        counts = fixed + kept.view(layers, heads, m).sum(-1).double() * tokens / m
        torch.testing.assert_close(got[s], (counts / counts.mean()).float(), atol=1e-5, rtol=0)


def test_kept_of_global_top_is_one_for_kvzip_shares_with_a_perfect_predictor_and_lower_when_reversed():
    layers, heads, m, tokens, fixed = 2, 3, 40, 200, 5
    log_scores = torch.randn(layers, heads, m, generator=torch.Generator().manual_seed(3)) * 2
    hidden = log_scores.transpose(1, 2)
    weight = torch.eye(heads)[None].repeat(layers, 1, 1)
    tensors = {"weight": weight, "bias": torch.zeros(layers, heads)}
    perfect = KVzapModel("linear", tensors, torch.ones(1, layers, heads), torch.tensor([0.5]))
    shares = predicted_shares(perfect, hidden, log_scores, [0.25], tokens, fixed)
    model = KVzapModel("linear", tensors, shares, torch.tensor([0.25]))
    assert kept_of_global_top(model, hidden, log_scores, [0.25], tokens, fixed)[0] == pytest.approx(
        (1.0, 1.0), abs=1e-6
    )
    reversed_ = KVzapModel("linear", {"weight": -weight, "bias": tensors["bias"]}, shares, torch.tensor([0.25]))
    [(mass, entries)] = kept_of_global_top(reversed_, hidden, log_scores, [0.25], tokens, fixed)
    assert mass < 0.5 and entries < 0.2
