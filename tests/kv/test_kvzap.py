"""The learned one-pass scorer (KVzap) and its calibrated shares on tiny models: the hidden states the
cache records are the layers' attention inputs, the kept sets follow the predictor, the shares keep
the row's total, files are checked against the model they were made for."""

import pytest
import torch

from pipeline.engine.kvzap_file import load_kvzap, model_fingerprint, read_metadata, resolve_kvzap, write_kvzap
from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.kvzap_model import KVzapModel
from pipeline.kv.rope import model_rotary
from pipeline.kv.scorers.kvzap import MAX_LOG_SCORE
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from tests.kv.reference import stage1_reference, topk_indices, two_stage_reference, value_norm_reference
from tests.tiny import DEVICE, tiny_kvzap, tiny_kvzap_for, tiny_loaded, tiny_model

N, PAD = 40, 9  # row 1 is PAD tokens shorter (left padded)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, N), generator=g).to(DEVICE)
    pos = torch.arange(N, device=DEVICE).repeat(2, 1)
    pos[1] = torch.arange(N, device=DEVICE) - PAD
    pos[1, :PAD] = -1
    ids[1, :PAD] = 258
    return ids, pos


def _attention_inputs(model, ids):
    """Independent reference: each layer's input norm applied to the residual stream of one unpadded row."""
    model.set_attn_implementation("sdpa")
    out = model(input_ids=ids[None], output_hidden_states=True)
    return [layer.input_layernorm(out.hidden_states[i][0]) for i, layer in enumerate(model.model.layers)]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kept_sets_follow_the_predictor_on_the_attention_inputs(arch, kind):
    model = tiny_model(arch, seed=2)
    kvzap = tiny_kvzap_for(model, seed=3, kind=kind)
    config = CompressionConfig(method="kvzap", cache_size=0.3, window=4, sink_tokens=2)
    model.set_attn_implementation(register())
    cache = VarLenCache(model.config.num_hidden_layers, Compressor(config, kvzap=kvzap, rotary=model_rotary(model)))
    ids, pos = _batch()
    run_chunk(model, cache, ids, pos)
    for row, pad in ((0, 0), (1, PAD)):
        n = N - pad
        hidden = _attention_inputs(model, ids[row, pad:])
        budget = round(0.3 * n)
        for layer, h in enumerate(hidden):
            pred = kvzap.predict(layer, h[None], torch.arange(n)[None], torch.tensor([n]))[0]  # (H_kv, n)
            for head in range(pred.shape[0]):
                score = pred[head].clamp(max=MAX_LOG_SCORE)  # the scorer's exp() saturates there
                score[:2] = float("inf")
                score[n - 4 :] = float("inf")
                expected = topk_indices(score.tolist(), budget)  # ties (repeated tokens in layer 0): lower index
                assert cache.kept_positions(layer, row, head).tolist() == expected


def _criticalkv_kept(model, kvzap, ratio):
    """criticalkv-kvzap at 0.5 on the test batch -> (config, ids, {(layer, row, head): kept positions})."""
    config = CompressionConfig(
        method="criticalkv-kvzap", cache_size=0.5, window=4, sink_tokens=2, first_stage_ratio=ratio
    )
    cache = VarLenCache(model.config.num_hidden_layers, Compressor(config, kvzap=kvzap, rotary=model_rotary(model)))
    ids, pos = _batch()
    run_chunk(model, cache, ids, pos)
    heads = model.config.num_key_value_heads
    keys = [
        (layer, row, head) for layer in range(model.config.num_hidden_layers) for row in (0, 1) for head in range(heads)
    ]
    return config, ids, {key: cache.kept_positions(*key).tolist() for key in keys}


def test_criticalkv_on_the_predicted_scores_matches_the_two_stage_reference():
    """The compressor tells CriticalKV that KVzap's scores weigh the value norm already, so its default
    stage-1 ratio is the one documented for such scores, not the paper's 0.5 (which a set value gives)."""
    model = tiny_model("llama", seed=2)
    model.set_attn_implementation(register())
    kvzap = tiny_kvzap_for(model, seed=3)
    for name in ("weight", "position_weight"):  # flat predictions: stage 2's value norms decide part of the set
        kvzap.tensors[name] = kvzap.tensors[name] * 0.03
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    groups = model.config.num_attention_heads // heads
    kept_sets = []
    for ratio in (None, 0.5):
        config, ids, kept = _criticalkv_kept(model, kvzap, ratio)
        kept_sets.append(kept)
        for row, pad in ((0, 0), (1, PAD)):
            n = N - pad
            for layer, h in enumerate(_attention_inputs(model, ids[row, pad:])):
                attn = model.model.layers[layer].self_attn
                value = attn.v_proj(h).view(n, heads, dim).detach()
                pred = kvzap.predict(layer, h[None], torch.arange(n)[None], torch.tensor([n]))[0]
                for head in range(heads):
                    score = pred[head].clamp(max=MAX_LOG_SCORE).exp()
                    score[:2] = float("inf")
                    score[n - 4 :] = float("inf")
                    norms = value_norm_reference(value[:, head], attn.o_proj.weight.detach(), head, groups, dim)
                    expected = two_stage_reference(
                        score.tolist(), norms, round(0.5 * n), 4, stage1_reference(config), config.epsilon
                    )
                    assert kept[(layer, row, head)] == expected
        model.set_attn_implementation(register())  # _attention_inputs switched it to sdpa
    assert kept_sets[0] != kept_sets[1], "the test must tell the two ratios apart"


def test_shares_keep_the_row_total_and_follow_the_shares():
    model = tiny_model("llama", layers=4)
    kvzap = tiny_kvzap_for(model, seed=5)
    config = CompressionConfig(method="shares-knorm", cache_size=0.25, window=2)
    model.set_attn_implementation(register())
    cache = VarLenCache(4, Compressor(config, kvzap=kvzap))
    ids, pos = _batch(1)
    run_chunk(model, cache, ids, pos)
    heads = model.config.num_key_value_heads
    for row, n in ((0, N), (1, N - PAD)):
        counts = torch.tensor(
            [[cache.kept_positions(layer, row, h).numel() for h in range(heads)] for layer in range(4)]
        )
        pool = 4 * heads * round(0.25 * n)
        assert pool - 4 * heads <= int(counts.sum()) <= pool  # rounded down per head, never above the pool
        shares = kvzap.shares_at(torch.tensor([round(0.25 * n) / n]), torch.tensor([n]))[0]
        top, low = shares.flatten().argmax(), shares.flatten().argmin()
        assert counts.flatten()[top] >= counts.flatten()[low]


def test_shares_interpolate_between_calibrated_sizes():
    shares = torch.stack([torch.full((2, 2), 1.0), torch.tensor([[2.0, 0.0], [1.0, 1.0]])])
    model = KVzapModel(
        "linear", {"weight": torch.zeros(2, 2, 3), "bias": torch.zeros(2, 2)}, shares, torch.tensor([0.1, 0.3])
    )
    got = model.shares_at(torch.tensor([0.05, 0.2, 0.3, 0.9]))
    assert got[0].tolist() == [[1.0, 1.0], [1.0, 1.0]]  # clamped to the first size
    torch.testing.assert_close(got[1], torch.tensor([[1.5, 0.5], [1.0, 1.0]], dtype=torch.float64))
    assert got[2].tolist() == got[3].tolist() == [[2.0, 0.0], [1.0, 1.0]]


def test_shares_interpolate_in_log_length_between_calibrated_lengths():
    """Two lengths x two sizes: linear in the fraction within each length's table, then linear in
    log length (the geometric mean of 100 and 400 tokens is half way), clamped at both ends."""
    ones, skew = torch.ones(2, 2), torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    shares = torch.stack([torch.stack([ones, ones]), torch.stack([skew, ones])])  # (N=2, S=2, L=2, H=2)
    weights = {"weight": torch.zeros(2, 2, 3), "bias": torch.zeros(2, 2)}
    model = KVzapModel("linear", weights, shares, torch.tensor([0.1, 0.3]), torch.tensor([100.0, 400.0]))
    fractions = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.1])
    got = model.shares_at(fractions, torch.tensor([50, 100, 200, 400, 9000]))
    assert got[0].tolist() == got[1].tolist() == ones.tolist()  # at / below the first length
    torch.testing.assert_close(got[2], ((ones + skew) / 2).double())  # log-midpoint of 100 and 400
    torch.testing.assert_close(got[3], ((skew + ones) / 2).double())  # half way between the 400 table's sizes
    assert got[4].tolist() == skew.tolist()  # clamped to the last length
    with pytest.raises(ValueError, match="calibrated per context length"):
        model.shares_at(fractions)
    with pytest.raises(ValueError, match="share_lengths must be"):
        KVzapModel("linear", weights, shares, torch.tensor([0.1, 0.3]), torch.tensor([400.0, 100.0]))


def test_shares_allocation_matches_the_reference_with_one_table_or_per_length():
    from pipeline.kv.allocation.shares import shares_counts
    from tests.kv.reference import shares_reference

    for lengths in (None, (8, 32)):
        kvzap = tiny_kvzap(3, 2, 16, seed=4, lengths=lengths)
        rows = torch.tensor([40, 23, 11])
        budget, window = torch.tensor([9, 5, 4]), torch.tensor([2, 2, 2])
        shares = kvzap.shares_at(budget.double() / rows.double(), rows if lengths else None)
        counts = shares_counts(shares, budget, window, rows)  # (B, L, H)
        got = [counts[:, layer] for layer in range(3)]
        extra = () if lengths is None else (list(lengths),)
        for b in range(3):
            ref = shares_reference(
                kvzap.share_sizes.tolist(), kvzap.shares.tolist(), int(budget[b]), 2, int(rows[b]), *extra
            )
            assert [g[b].tolist() for g in got] == ref


def test_method_without_a_kvzap_model_is_refused():
    with pytest.raises(ValueError, match="needs a KVzap model"):
        Compressor(CompressionConfig(method="kvzap", cache_size=0.2))
    Compressor(CompressionConfig(method="kvzap", cache_size=1.0))  # keeps everything: nothing to predict


def test_file_round_trip_and_refusal_of_another_model(tmp_path):
    loaded = tiny_loaded("llama")
    kvzap = tiny_kvzap_for(loaded.model, seed=1, kind="mlp")
    path = write_kvzap(tmp_path / "k.safetensors", kvzap, loaded.name, model_fingerprint(loaded.model), {"a": 1}, {})
    back = load_kvzap(path, loaded.model, loaded.name)
    assert back.kind == "mlp" and read_metadata(path)["fit"] == {"a": 1}
    h = torch.randn(1, 5, loaded.model.config.hidden_size, device=DEVICE)
    at = (torch.arange(5)[None], torch.tensor([9]))
    torch.testing.assert_close(back.predict(1, h, *at), kvzap.predict(1, h, *at))
    assert back.uses_positions
    assert back.share_lengths.tolist() == kvzap.share_lengths.tolist()
    torch.testing.assert_close(back.shares, kvzap.shares)
    single = tiny_kvzap_for(loaded.model, seed=2, lengths=None)  # a file with one shares table still loads
    path1 = write_kvzap(tmp_path / "one.safetensors", single, loaded.name, model_fingerprint(loaded.model), {}, {})
    back1 = load_kvzap(path1, loaded.model, loaded.name)
    assert back1.share_lengths is None
    fraction = torch.tensor([0.25])
    torch.testing.assert_close(back1.shares_at(fraction), single.shares_at(fraction))
    other = tiny_loaded("llama", seed=9)  # same shape, other weights
    with pytest.raises(ValueError, match="calibrated for model 'tiny-llama'.*weights differ"):
        load_kvzap(path, other.model, "other-model")
    qwen = tiny_loaded("qwen3")
    with pytest.raises(ValueError, match="model_type llama vs qwen3|num_kv_heads"):
        load_kvzap(path, qwen.model, qwen.name)


def test_resolve_names_the_file_and_both_models(tmp_path):
    loaded = tiny_loaded("llama")
    kvzap = tiny_kvzap(2, 2, 64)
    path = write_kvzap(tmp_path / "k.safetensors", kvzap, "tiny-llama", model_fingerprint(loaded.model), {}, {})
    config = CompressionConfig(method="criticalkv-shares-kvzap", cache_size=0.2, kvzap_model=path)
    assert resolve_kvzap(config, "tiny-llama").kvzap_model == path
    with pytest.raises(ValueError, match="calibrated for model 'tiny-llama', but this run uses model 'smollm3'"):
        resolve_kvzap(config, "smollm3")
    with pytest.raises(ValueError, match="kvzap_model: file not found"):
        resolve_kvzap(config.model_copy(update={"kvzap_model": tmp_path / "missing"}), "tiny-llama")
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        resolve_kvzap(config.model_copy(update={"kvzap_model": tmp_path / "bad.safetensors"}), "tiny-llama")
    with pytest.raises(ValueError, match="none ships for model 'tiny-llama'"):
        resolve_kvzap(CompressionConfig(method="kvzap", cache_size=0.2), "tiny-llama")
    assert resolve_kvzap(CompressionConfig(method="kvzap", cache_size=0.2), "smollm2").kvzap_model.is_file()


def test_position_term_matches_the_naive_reference_at_batch_2_with_left_padding():
    from tests.kv.reference import kvzap_position_term

    kvzap = tiny_kvzap(3, 2, 16, seed=8)
    _, pos = _batch()
    lengths = torch.tensor([N, N - PAD])
    term = kvzap.position_term(1, pos.cpu(), lengths)  # (B, H_kv, n)
    weight = kvzap.tensors["position_weight"][1].tolist()
    for row, pad in ((0, 0), (1, PAD)):
        n = N - pad
        for head in range(2):
            expected = [kvzap_position_term(weight[head], j, n) for j in range(n)]
            assert term[row, head, pad:].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-5)
    with pytest.raises(ValueError, match="positions"):
        kvzap.predict(0, torch.randn(1, 4, 16))
    plain = tiny_kvzap(3, 2, 16, seed=8, positions=False)
    h = torch.randn(1, 4, 16)
    torch.testing.assert_close(plain.predict(0, h), plain.predict_from_hidden(0, h))


def test_a_bad_position_weight_is_refused():
    kvzap = tiny_kvzap(2, 2, 8)
    tensors = dict(kvzap.tensors, position_weight=torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="position_weight"):
        KVzapModel("linear", tensors, kvzap.shares, kvzap.share_sizes, kvzap.share_lengths)
