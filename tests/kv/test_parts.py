"""Every registered part against its naive reference (tests/kv/reference.py), on random tensors.

The parameters come from the registries: a new scorer, allocation or selection is tested here as
soon as it is registered, and fails until its naive reference exists.
"""

import math

import pytest
import torch

from pipeline.kv.allocation import ALLOCATIONS, row_budgets
from pipeline.kv.config import CompressionConfig, method_name
from pipeline.kv.parts import LayerContext, LayerInputs
from pipeline.kv.phases import Phase
from pipeline.kv.scorers import SCORERS
from pipeline.kv.selection import SELECTIONS
from pipeline.kv.value_norms import NormStats, OutputProjection
from tests.tiny import tiny_kvzap

from .reference import ALLOCATION_REFERENCES, SCORER_REFERENCES, SELECTION_REFERENCES

H_Q, H_KV, D, HIDDEN, WINDOW = 4, 2, 8, 24, 4
LENGTHS = (40, 29)  # a batch of two rows, the second left padded


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _batch(seed=0):
    """q (B, H_q, n, D), k, v (B, H_kv, n, D), key_pos (B, n): real tokens right-aligned."""
    n = max(LENGTHS)
    q, k, v = (
        _rand(2, H_Q, n, D, seed=seed) * 2,
        _rand(2, H_KV, n, D, seed=seed + 1) * 2,
        _rand(2, H_KV, n, D, seed=seed + 2),
    )
    pos = torch.full((2, n), -1)
    for b, length in enumerate(LENGTHS):
        pos[b, n - length :] = torch.arange(length)
        q[b, :, : n - length] = k[b, :, : n - length] = v[b, :, : n - length] = 0.0
    return q, k, v, pos


def rotary(positions):
    """Standard RoPE (base 10000) for head_dim D, as a model's rotary embedding returns it."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


KVZAP = tiny_kvzap(2, H_KV, HIDDEN, seed=11)


def _hidden(pos, seed=6):
    """Attention inputs (B, n, HIDDEN), zero on padding (KVzap's features)."""
    return _rand(pos.shape[0], pos.shape[1], HIDDEN, seed=seed) * 0.3 * (pos >= 0)[..., None]


def _context(config, q, k, v, pos, scorer, layer=0, priors=None, o_weight=None, kvzap=KVZAP):
    lengths = (pos >= 0).sum(-1)
    row_b, row_w = row_budgets(lengths, config.cache_size, config.budget, config.window)
    proj = OutputProjection.from_weight(o_weight if o_weight is not None else _rand(HIDDEN, H_Q * D, seed=9), H_KV, D)
    return LayerContext(
        layer_idx=layer,
        key=k,
        value=v,
        key_pos=pos,
        scaling=D**-0.5,
        lengths=lengths,
        row_budget=row_b,
        row_window=row_w,
        observed=scorer.observe(
            q, pos, scorer.options_from(config), config.window, rotary, inputs=LayerInputs(layer, _hidden(pos), kvzap)
        ),
        projection=lambda: proj,
        head_priors=priors,
        kvzap=kvzap,
        selection_weighs_values=SELECTIONS[config.selection].weighs_by_value_norm,
        scorer_weighs_values=scorer.weighs_by_value_norm,
    )


def _config(**parts):
    # small future horizon: the naive ExpectedAttention reference builds every rotation by hand
    return CompressionConfig(method=method_name(**parts), cache_size=0.3, window=WINDOW, kernel=3, future_positions=7)


@pytest.mark.parametrize("selection", list(SELECTIONS))
@pytest.mark.parametrize("name", list(SCORERS))
def test_scorer_matches_reference(name, selection):
    """Under each selection: a scorer may leave a weighting to the selection (ExpectedAttention's ||V||
    under CriticalKV)."""
    assert name in SCORER_REFERENCES, f"scorer {name!r} has no naive reference in tests/kv/reference.py"
    cfg = _config(scorer=name, selection=selection)
    q, k, v, pos = _batch(1)
    scorer = SCORERS[name]
    ctx = _context(cfg, q, k, v, pos, scorer)
    passes = None
    if scorer.decides is Phase.PASSES:  # its algorithm is in the passes (tests/kv/test_kvzip.py): here the conventions
        passes = torch.rand(2, H_KV, max(LENGTHS), generator=torch.Generator().manual_seed(4))
        ctx.observed = passes
    got = scorer.score(ctx, scorer.options_from(cfg))
    assert got.shape == (2, H_KV, max(LENGTHS)) and got.dtype == torch.float32
    for b, length in enumerate(LENGTHS):
        pad = max(LENGTHS) - length
        assert torch.isneginf(got[b, :, :pad]).all(), "padding must score -inf"
        observed = None if passes is None else passes[b, :, pad:].tolist()
        ref = SCORER_REFERENCES[name](
            q[b, :, pad:],
            k[b, :, pad:],
            v[b, :, pad:],
            min(WINDOW, length),
            cfg,
            D**-0.5,
            observed=observed,
            hidden=_hidden(pos)[b, pad:].tolist(),
            kvzap=(
                KVZAP.tensors["weight"][0].tolist(),
                KVZAP.tensors["bias"][0].tolist(),
                KVZAP.tensors["position_weight"][0].tolist(),
            ),
        )
        for h in range(H_KV):
            for j in range(length):
                if math.isinf(ref[h][j]):
                    assert math.isinf(float(got[b, h, pad + j])) and float(got[b, h, pad + j]) > 0
                else:
                    assert float(got[b, h, pad + j]) == pytest.approx(ref[h][j], rel=1e-4, abs=1e-6)


def _peaked_scores(seed, n):
    torch.manual_seed(seed)
    scores = torch.rand(2, H_KV, n) ** 4
    scores[0, 0] *= 5  # one head dominates
    pos = torch.full((2, n), -1)
    for b, length in enumerate(LENGTHS):
        pos[b, n - length :] = torch.arange(length)
        scores[b, :, : n - length] = float("-inf")
        scores[b, :, n - min(WINDOW, length) :] = float("inf")
    return scores, pos


@pytest.mark.parametrize("name", list(ALLOCATIONS))
def test_allocation_matches_reference(name):
    """Every allocation through ``model_head_budgets`` (two layers' scores at once; per-layer
    allocations decide each layer alone) against its reference."""
    assert name in ALLOCATION_REFERENCES, f"allocation {name!r} has no naive reference in tests/kv/reference.py"
    cfg = _config(scorer="snapkv", allocation=name)
    n = max(LENGTHS)
    scores = [_peaked_scores(3 + layer, n)[0] for layer in range(2)]
    pos = _peaked_scores(3, n)[1]
    priors = torch.tensor([[0.9, 0.1], [0.3, 0.6]], dtype=torch.float64)
    _, k, v, _ = _batch(2)
    contexts = [
        _context(cfg, k[:, :1].expand(-1, H_Q, -1, -1), k, v, pos, SCORERS["snapkv"], layer, priors)
        for layer in range(2)
    ]
    got = ALLOCATIONS[name].model_head_budgets(scores, contexts, ALLOCATIONS[name].options_from(cfg))
    for b, length in enumerate(LENGTHS):
        budget, window = int(contexts[0].row_budget[b]), int(contexts[0].row_window[b])
        rows = [s[b, :, n - length :].tolist() for s in scores]
        shares = (KVZAP.share_sizes.tolist(), KVZAP.shares.tolist(), KVZAP.share_lengths.tolist())
        ref = ALLOCATION_REFERENCES[name](rows, budget, window, length, cfg, priors.tolist(), shares=shares)
        assert [g[b].tolist() for g in got] == ref


@pytest.mark.parametrize("name", list(SELECTIONS))
@pytest.mark.parametrize("norm", ["l1", "l2"])
@pytest.mark.parametrize("scorer", ["snapkv", "kvzap"])  # scores without and with the value norm in them
def test_selection_matches_reference(name, norm, scorer):
    assert name in SELECTION_REFERENCES, f"selection {name!r} has no naive reference in tests/kv/reference.py"
    cfg = _config(scorer=scorer, selection=name).with_method(norm=norm)
    n = max(LENGTHS)
    scores, pos = _peaked_scores(4, n)
    _, k, v, _ = _batch(3)
    v = v * torch.rand(2, H_KV, n, 1, generator=torch.Generator().manual_seed(5)) * 3
    o_weight = _rand(HIDDEN, H_Q * D, seed=6)
    ctx = _context(cfg, k[:, :1].expand(-1, H_Q, -1, -1), k, v, pos, SCORERS[scorer], o_weight=o_weight)
    budgets = torch.tensor([[12, 7], [5, 9]])
    keep, _ = SELECTIONS[name].select(scores, budgets, ctx, SELECTIONS[name].options_from(cfg), NormStats())
    for b, length in enumerate(LENGTHS):
        pad = n - length
        assert not keep[b, :, :pad].any(), "padding is never kept"
        for h in range(H_KV):
            ref = SELECTION_REFERENCES[name](
                scores[b, h, pad:].tolist(),
                v[b, h, pad:],
                o_weight,
                h,
                H_Q // H_KV,
                D,
                int(budgets[b, h]),
                int(ctx.row_window[b]),
                cfg,
            )
            assert (keep[b, h, pad:].nonzero().flatten()).tolist() == ref
