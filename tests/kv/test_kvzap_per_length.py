"""A KVzap file with one linear predictor per context length: its predictions at a row's length
against a naive interpolation, the kept sets of rows at those lengths against the single predictors
it was made of (batch 2, left padding), the file round trip and its refusals."""

import math

import pytest
import torch

from pipeline.engine.kvzap_file import load_kvzap, model_fingerprint, per_length_file, write_kvzap
from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.kvzap_model import KVzapModel, per_length_model
from pipeline.kv.rope import model_rotary
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from tests.tiny import DEVICE, tiny_kvzap_for, tiny_model

N, PAD = 40, 9  # row 0 has N tokens, row 1 N - PAD (left padded)


def _naive_prediction(model: KVzapModel, layer: int, h: torch.Tensor, n: int) -> torch.Tensor:
    """h: (m, hidden) -> (H_kv, m): each length's predictor, mixed linearly in log length, by loops."""
    lengths = model.share_lengths.tolist()
    x = min(max(math.log(n), math.log(lengths[0])), math.log(lengths[-1]))
    for i in range(len(lengths) - 1):
        lo, hi = math.log(lengths[i]), math.log(lengths[i + 1])
        if x <= hi:
            t = (x - lo) / (hi - lo)
            break
    one = [h @ model.tensors["weight"][k, layer].T + model.tensors["bias"][k, layer] for k in (i, i + 1)]
    return ((1 - t) * one[0] + t * one[1]).T


def test_predictions_at_each_rows_length_match_the_naive_interpolation():
    g = torch.Generator().manual_seed(0)
    tensors = {"weight": torch.randn(3, 2, 2, 6, generator=g), "bias": torch.randn(3, 2, 2, generator=g)}
    model = KVzapModel("linear", tensors, torch.ones(3, 1, 2, 2), torch.tensor([0.2]), torch.tensor([64.0, 256, 1024]))
    assert model.per_length
    hidden = torch.randn(5, 7, 6, generator=g)
    lengths = torch.tensor([10, 64, 100, 700, 5000])  # below, at, between, between, above the calibrated ones
    got = model.predict(1, hidden, lengths=lengths)
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(got[row], _naive_prediction(model, 1, hidden[row], n), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="context lengths"):
        model.predict(1, hidden)


def test_rows_at_the_calibrated_lengths_keep_what_their_own_predictor_keeps():
    model = tiny_model("llama", seed=2)
    model.set_attn_implementation(register())
    short, long = (tiny_kvzap_for(model, seed=s, lengths=None, positions=False) for s in (3, 4))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, N), generator=g).to(DEVICE)
    pos = torch.arange(N, device=DEVICE).repeat(2, 1)
    pos[1] = torch.arange(N, device=DEVICE) - PAD
    pos[1, :PAD], ids[1, :PAD] = -1, 258
    heads = model.config.num_key_value_heads

    def kept(kvzap):
        config = CompressionConfig(method="criticalkv-kvzap", cache_size=0.3, window=4, sink_tokens=2)
        cache = VarLenCache(model.config.num_hidden_layers, Compressor(config, kvzap=kvzap, rotary=model_rotary(model)))
        run_chunk(model, cache, ids, pos)
        keys = [
            (row, layer, h) for row in (0, 1) for layer in range(model.config.num_hidden_layers) for h in range(heads)
        ]
        return {key: cache.kept_positions(key[1], key[0], key[2]).tolist() for key in keys}

    both = kept(per_length_model([short, long], [N - PAD, N]))
    alone_short, alone_long = kept(short), kept(long)
    assert {k: v for k, v in both.items() if k[0] == 1} == {k: v for k, v in alone_short.items() if k[0] == 1}
    assert {k: v for k, v in both.items() if k[0] == 0} == {k: v for k, v in alone_long.items() if k[0] == 0}
    assert alone_short != alone_long  # the two predictors keep different sets, so the test can fail


def test_file_round_trip_and_bad_shapes_are_refused(tmp_path):
    model = tiny_model("llama", seed=2)
    short, long = (tiny_kvzap_for(model, seed=s, lengths=None, positions=False) for s in (3, 4))
    kvzap = per_length_model([short, long], [N - PAD, N])
    torch.testing.assert_close(kvzap.shares, torch.stack([short.shares, long.shares]))
    path = write_kvzap(tmp_path / "k.safetensors", kvzap, "tiny", model_fingerprint(model), {}, {})
    loaded = load_kvzap(path, model, "tiny")
    assert loaded.per_length
    torch.testing.assert_close(loaded.tensors["weight"], kvzap.tensors["weight"].to(loaded.tensors["weight"].device))
    bad = {"weight": kvzap.tensors["weight"], "bias": kvzap.tensors["bias"][0]}
    with pytest.raises(ValueError, match="per-length"):
        KVzapModel("linear", bad, kvzap.shares, kvzap.share_sizes, kvzap.share_lengths)
    with pytest.raises(ValueError, match="per-length"):
        KVzapModel("linear", dict(kvzap.tensors), kvzap.shares[0], kvzap.share_sizes)
    with pytest.raises(ValueError, match="one pooled linear predictor"):
        per_length_model([short, tiny_kvzap_for(model, seed=5, lengths=(8, 32), positions=False)], [8, 32])


def test_per_length_file_combines_files_with_their_fit_and_settings(tmp_path):
    model = tiny_model("llama", seed=2)
    short, long = (tiny_kvzap_for(model, seed=s, lengths=None, positions=False) for s in (3, 4))
    paths = [
        write_kvzap(tmp_path / f"{n}.safetensors", m, "tiny", model_fingerprint(model), {"mean": {"r2": n}}, {"n": n})
        for n, m in ((N - PAD, short), (N, long))
    ]
    combined, fit, settings = per_length_file(paths, [N - PAD, N])
    expected = per_length_model([short, long], [N - PAD, N])
    for name in ("weight", "bias"):
        torch.testing.assert_close(combined.tensors[name], expected.tensors[name].cpu())
    torch.testing.assert_close(combined.shares, expected.shares.cpu())
    assert fit == {"per_length": {str(N - PAD): {"r2": N - PAD}, str(N): {"r2": N}}}
    assert settings == {"per_length": {str(N - PAD): {"n": N - PAD}, str(N): {"n": N}}}
