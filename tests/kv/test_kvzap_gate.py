"""The Fast-KVzip-style gate (experimental KVzap kind ``gate``) against a naive reference by loops, at
batch 2, and the binary cross-entropy gradient it is trained with."""

import math

import pytest
import torch

from pipeline.kv.kvzap_gate import gate_log_scores
from pipeline.kv.kvzap_model import KVzapModel
from tests.tiny import tiny_kvzap


def _rms(x: list[float], w: list[float]) -> list[float]:
    scale = 1 / math.sqrt(sum(v * v for v in x) / len(x) + 1e-6)
    return [v * scale * wi for v, wi in zip(x, w)]


def _naive_gate(t: dict, layer: int, h: list[float]) -> list[float]:
    """One entry's gate per KV head: mean over the group of 1 / (1 + sum_s exp(sink_s.q - key.q)), by loops."""
    sinks, bias = t["sink_keys"][layer].tolist(), t["gate_bias"][layer].tolist()
    heads, groups, rank = len(sinks), len(bias[0]), len(sinks[0][0])
    qw, qb, kw = t["q_weight"][layer].tolist(), t["q_bias"][layer].tolist(), t["k_weight"][layer].tolist()
    q_all = [sum(w * x for w, x in zip(row, h)) + b for row, b in zip(qw, qb)]
    k_all = [sum(w * x for w, x in zip(row, h)) for row in kw]
    out = []
    for head in range(heads):
        key = _rms(k_all[head * rank : (head + 1) * rank], t["k_norm"][layer].tolist())
        total = 0.0
        for g in range(groups):
            start = (head * groups + g) * rank
            q = _rms(q_all[start : start + rank], t["q_norm"][layer].tolist())
            own = sum(a * b for a, b in zip(key, q)) / math.sqrt(rank) + bias[head][g]
            rest = sum(math.exp(sum(a * b for a, b in zip(s, q)) / math.sqrt(rank) - own) for s in sinks[head])
            total += 1 / (1 + rest)
        out.append(math.log(total / groups))
    return out


def test_gate_matches_the_naive_reference_at_batch_2():
    model = tiny_kvzap(num_layers=2, num_kv_heads=3, hidden=10, seed=1, kind="gate", lengths=None)
    hidden = torch.randn(2, 5, 10, generator=torch.Generator().manual_seed(0))
    for layer in range(2):
        got = model.predict_from_hidden(layer, hidden)  # (B, H, n)
        assert got.shape == (2, 3, 5)
        for b in range(2):
            for i in range(5):
                expected = _naive_gate(model.tensors, layer, hidden[b, i].tolist())
                torch.testing.assert_close(got[b, :, i], torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert bool((got < 0).all())  # a gate in (0, 1)


def test_gate_is_differentiable_and_a_missing_tensor_is_refused():
    model = tiny_kvzap(num_layers=1, num_kv_heads=2, hidden=6, seed=2, kind="gate", lengths=None)
    tensors = {name: t.clone().requires_grad_() for name, t in model.tensors.items()}
    gate_log_scores(tensors, 0, torch.randn(1, 4, 6)).sum().backward()
    assert all(t.grad is not None and bool(t.grad.abs().sum() > 0) for t in tensors.values())
    partial = {k: v for k, v in model.tensors.items() if k != "sink_keys"}
    with pytest.raises(ValueError, match="sink_keys"):
        KVzapModel("gate", partial, model.shares, model.share_sizes)
