"""A KVzap file with one linear predictor per (context length, kept fraction): its predictions against
a naive double interpolation, the kept sets of rows below and above its fractions against the per-length
files it was made of (batch 2, left padding), the shares it takes from each, the file round trip and
its refusals."""

import math

import pytest
import torch

from pipeline.engine.kvzap_file import load_kvzap, model_fingerprint, write_kvzap
from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.kvzap_model import KVzapModel, per_length_model, per_size_model
from pipeline.kv.rope import model_rotary
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from tests.tiny import DEVICE, tiny_kvzap_for, tiny_model

N, PAD = 40, 9  # row 0 has N tokens, row 1 N - PAD (left padded)


def _weight(points: list[float], x: float) -> tuple[int, float]:
    """Index i and weight t of the naive linear reading between points[i] and points[i + 1] at x (clamped)."""
    x = min(max(x, points[0]), points[-1])
    for i in range(len(points) - 1):
        if x <= points[i + 1]:
            return i, (x - points[i]) / (points[i + 1] - points[i])
    raise AssertionError("unreachable")


def _naive(model: KVzapModel, layer: int, h: torch.Tensor, n: int, fraction: float) -> torch.Tensor:
    """h: (m, hidden) -> (H_kv, m): predictors mixed linearly in the kept fraction, then in log length."""
    w, b = model.tensors["weight"], model.tensors["bias"]
    i, t = _weight([math.log(x) for x in model.share_lengths.tolist()], math.log(n))
    j, u = _weight(model.predictor_sizes.tolist(), fraction)

    def at_length(k: int) -> torch.Tensor:
        one = [h @ w[k, p, layer].T + b[k, p, layer] for p in (j, j + 1)]
        return (1 - u) * one[0] + u * one[1]

    return ((1 - t) * at_length(i) + t * at_length(i + 1)).T


def test_predictions_at_each_rows_length_and_fraction_match_the_naive_interpolation():
    g = torch.Generator().manual_seed(0)
    tensors = {"weight": torch.randn(2, 3, 2, 2, 6, generator=g), "bias": torch.randn(2, 3, 2, 2, generator=g)}
    sizes = torch.tensor([0.1, 0.2, 0.4])
    model = KVzapModel("linear", tensors, torch.ones(2, 1, 2, 2), torch.tensor([0.2]), torch.tensor([64.0, 256]), sizes)
    assert model.per_length and model.per_size
    hidden = torch.randn(6, 7, 6, generator=g)
    lengths = torch.tensor([10, 64, 100, 200, 256, 5000])
    fractions = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4, 0.9])  # below, at, between, between, at, above
    got = model.predict(1, hidden, lengths=lengths, fractions=fractions)
    for row, (n, f) in enumerate(zip(lengths.tolist(), fractions.tolist())):
        torch.testing.assert_close(got[row], _naive(model, 1, hidden[row], n, f), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kept fractions"):
        model.predict(1, hidden, lengths=lengths)


def _two_files(model):
    """Two per-length files with different predictors and the same shares (so only the predictor differs)."""
    a = per_length_model([tiny_kvzap_for(model, seed=s, lengths=None, positions=False) for s in (3, 4)], [N - PAD, N])
    b = per_length_model([tiny_kvzap_for(model, seed=s, lengths=None, positions=False) for s in (5, 6)], [N - PAD, N])
    return a, KVzapModel("linear", b.tensors, a.shares, a.share_sizes, a.share_lengths)


def test_rows_below_and_above_the_fractions_keep_what_each_file_keeps():
    model = tiny_model("llama", seed=2)
    model.set_attn_implementation(register())
    small, large = _two_files(model)
    both = per_size_model([small, large], [0.35, 0.5])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, N), generator=g).to(DEVICE)
    pos = torch.arange(N, device=DEVICE).repeat(2, 1)
    pos[1] = torch.arange(N, device=DEVICE) - PAD
    pos[1, :PAD], ids[1, :PAD] = -1, 258
    heads, layers = model.config.num_key_value_heads, model.config.num_hidden_layers

    def kept(kvzap, size):
        config = CompressionConfig(method="criticalkv-shares-kvzap", cache_size=size, window=4, sink_tokens=2)
        cache = VarLenCache(layers, Compressor(config, kvzap=kvzap, rotary=model_rotary(model)))
        run_chunk(model, cache, ids, pos)
        keys = [(row, layer, h) for row in (0, 1) for layer in range(layers) for h in range(heads)]
        return {key: cache.kept_positions(key[1], key[0], key[2]).tolist() for key in keys}

    assert kept(both, 0.3) == kept(small, 0.3) != kept(large, 0.3)
    assert kept(both, 0.6) == kept(large, 0.6) != kept(small, 0.6)


def test_shares_come_from_the_last_file_at_or_below_each_fraction():
    model = tiny_model("llama", seed=2)
    a, b = _two_files(model)
    b = KVzapModel("linear", b.tensors, a.shares * 2, a.share_sizes, a.share_lengths)  # tiny sizes 0.1 / 0.4 / 0.9
    both = per_size_model([a, b], [0.2, 0.4])
    torch.testing.assert_close(both.shares[:, 0], a.shares[:, 0])  # 0.1: below every fraction, the first file's
    torch.testing.assert_close(both.shares[:, 1:], b.shares[:, 1:])  # 0.4 and 0.9: the second file's
    torch.testing.assert_close(both.tensors["weight"][:, 1], b.tensors["weight"])


def test_file_round_trip_and_bad_shapes_are_refused(tmp_path):
    model = tiny_model("llama", seed=2)
    a, b = _two_files(model)
    both = per_size_model([a, b], [0.2, 0.5])
    path = write_kvzap(tmp_path / "k.safetensors", both, "tiny", model_fingerprint(model), {}, {})
    loaded = load_kvzap(path, model, "tiny")
    assert loaded.per_size
    torch.testing.assert_close(loaded.predictor_sizes.cpu(), torch.tensor([0.2, 0.5]))
    torch.testing.assert_close(loaded.tensors["weight"], both.tensors["weight"].to(loaded.tensors["weight"].device))
    with pytest.raises(ValueError, match="per-size"):
        KVzapModel("linear", dict(both.tensors), both.shares, both.share_sizes, both.share_lengths)
    with pytest.raises(ValueError, match="per-size"):
        KVzapModel(
            "linear", dict(both.tensors), both.shares, both.share_sizes, both.share_lengths, torch.tensor([0.5, 0.2])
        )
    with pytest.raises(ValueError, match="predictor_sizes need per-length"):
        one = {"weight": a.tensors["weight"][0], "bias": a.tensors["bias"][0]}
        KVzapModel("linear", one, a.shares[0], a.share_sizes, None, torch.tensor([0.2]))
    with pytest.raises(ValueError, match="ascending"):
        per_size_model([a, b], [0.5, 0.2])
    with pytest.raises(ValueError, match="per-length files"):
        per_size_model([both, a], [0.1, 0.2])
