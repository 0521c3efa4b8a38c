"""Layer-by-layer prefill in token slices (``pipeline.engine.layerwise`` + ``pipeline.kv.prefill.layer_by_layer``).

* every method whose scorer observes slices keeps exactly the one-pass prefill's entries, with the
  same last logits, at batch 2 with left padding, in slices shorter than the observation window and
  in one slice as long as the context; on every tiny architecture for the learned scorer;
* a method that decides per layer compresses each layer before the next one starts (one layer's
  dense K/V at a time), and the sliced state holds no buffer between layers;
* through the engine (batch path and continuous batching): the same answers and kept entries as one
  forward, KVzip's reconstruction passes included; scorers that need every query at once and models
  outside the supported families are prefilled in one forward;
* left unset (auto), 1024-token slices on CPU for the supported families, one forward elsewhere.
"""

import types

import pytest
import torch

from pipeline.engine import prefill as engine_prefill
from pipeline.engine.config import GenerationConfig
from pipeline.engine.engine import Engine
from pipeline.engine.layerwise import layerwise_prefill, usable_slice
from pipeline.engine.types import Request
from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.prefill.layer_by_layer import LayerByLayer
from pipeline.kv.prefill.rules import PrefillPlan, layer_timing, plan_prefill
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from tests.engine.test_engine import KVZAP_DIR, TEXT
from tests.kv.test_chunked import _compressor, _kept, _rows
from tests.methods import ALL_METHODS, one_method_per_part
from tests.tiny import ARCHS, DEVICE, tiny_kvzap_file, tiny_loaded, tiny_model

WHOLE_QUERIES = ("expected_attention",)  # scorers that observe every query of a layer at once
SLICEABLE = [m for m in ALL_METHODS if not m.endswith("kvzip") and not any(s in m for s in WHOLE_QUERIES)]


def _batch(rows):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), 258, dtype=torch.long, device=DEVICE)
    pos = torch.full((len(rows), width), -1, dtype=torch.long, device=DEVICE)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :], pos[b, width - len(r) :] = r, torch.arange(len(r), device=DEVICE)
    return ids, pos


def _plan(cache: VarLenCache, tokens: int) -> PrefillPlan:
    """A layer-by-layer plan of ``tokens`` per slice (also one slice as long as the context)."""
    return PrefillPlan("layer-by-layer", layer_timing(cache.compressor.config), tokens)


def _both(model, method, tokens, cache_size=0.3, rows=None):
    """(one-pass cache, its last logits), (layer-by-layer cache, its last logits) of the same rows
    (default: two rows, the second left padded)."""
    model.set_attn_implementation(register())
    rows = _rows(1) if rows is None else rows
    ids, pos = _batch(rows)
    layers = model.config.num_hidden_layers
    one = VarLenCache(layers, _compressor(model, method, cache_size))
    with torch.inference_mode():
        logits_one = run_chunk(model, one, ids, pos).logits[:, -1].float()
    sliced = VarLenCache(layers, _compressor(model, method, cache_size))
    logits_sliced = layerwise_prefill(model, sliced, ids, pos, _plan(sliced, tokens))
    return rows, (one, logits_one), (sliced, logits_sliced)


@pytest.mark.parametrize("method", SLICEABLE)
def test_small_slices_keep_the_one_pass_entries(method):
    model = tiny_model("llama", seed=1)
    rows, (one, logits_one), (sliced, logits_sliced) = _both(model, method, tokens=2)
    assert _kept(sliced, model, rows) == _kept(one, model, rows)
    torch.testing.assert_close(logits_sliced, logits_one, rtol=1e-5, atol=1e-5)
    assert sliced.prefill is None and torch.equal(sliced.context_entries, one.context_entries)


@pytest.mark.parametrize("method", [m for m in one_method_per_part() if m in SLICEABLE])
def test_one_slice_as_long_as_the_context_is_the_one_pass_prefill(method):
    model = tiny_model("qwen3", seed=2, layers=3)
    rows, (one, logits_one), (sliced, logits_sliced) = _both(model, method, tokens=64)
    assert _kept(sliced, model, rows) == _kept(one, model, rows)
    torch.testing.assert_close(logits_sliced, logits_one, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", [m for m in one_method_per_part() if m in SLICEABLE])
def test_one_unpadded_row_keeps_the_one_pass_entries(method):
    """Unpadded slices take the mask-free path on CPU (two fused calls merged by their log-sum-exps)."""
    model = tiny_model("llama", seed=4)
    rows, (one, logits_one), (sliced, logits_sliced) = _both(model, method, tokens=6, rows=_rows(3)[:1])
    assert _kept(sliced, model, rows) == _kept(one, model, rows)
    torch.testing.assert_close(logits_sliced, logits_one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("method", ["none", "criticalkv-shares-kvzap"])
def test_every_supported_architecture(arch, method):
    model = tiny_model(arch, seed=3, layers=3)
    rows, (one, logits_one), (sliced, logits_sliced) = _both(model, method, tokens=5)
    assert _kept(sliced, model, rows) == _kept(one, model, rows)
    torch.testing.assert_close(logits_sliced, logits_one, rtol=1e-5, atol=1e-5)


def test_each_layer_is_compressed_before_the_next_starts():
    model = tiny_model("llama", seed=1, layers=3)
    model.set_attn_implementation(register())
    ids, pos = _batch(_rows(1))
    cache = VarLenCache(3, _compressor(model, "criticalkv-shares-kvzap", 0.25))
    full_entries = int((pos >= 0).sum()) * model.config.num_key_value_heads
    seen = []

    def before_layer(layer_idx):
        def hook(module, args, kwargs):
            if cache.prefill.start == 0:  # the layer's first slice
                held = [cache.store[i] for i in range(layer_idx)]
                seen.append((layer_idx, cache.prefill.key is None, [int(s.length.sum()) for s in held]))
                assert cache.store[layer_idx] is None

        return hook

    for idx, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(before_layer(idx), with_kwargs=True)
    layerwise_prefill(model, cache, ids, pos, _plan(cache, 8))
    assert [s[0] for s in seen] == [0, 1, 2] and all(s[1] for s in seen)
    assert [len(s[2]) for s in seen] == [0, 1, 2]
    assert all(0 < held < full_entries for s in seen for held in s[2])  # compressed, not the dense layer
    assert int(cache.context_entries.sum()) <= round(0.25 * 3 * full_entries) + 3 * 2


def test_scorers_that_need_every_query_are_not_sliced():
    model = tiny_model("llama", seed=1)
    cache = VarLenCache(2, _compressor(model, "expected_attention", 0.3))
    assert plan_prefill(cache.compressor.config, 8, 40).forward == "one-pass"
    with pytest.raises(ValueError, match="every query at once"):
        LayerByLayer(cache, None, torch.zeros(1, 40, dtype=torch.long))
    snapkv = _compressor(model, "snapkv", 0.3).config
    assert plan_prefill(snapkv, 8, 40) == PrefillPlan("layer-by-layer", "at-once", 8)
    assert plan_prefill(snapkv, 8, 8).forward == "one-pass"  # one slice


def test_the_decode_time_cap_prefills_in_one_forward():
    capped = VarLenCache(
        2, Compressor(CompressionConfig(method="snapkv", cache_size=0.3, window=4, max_cache_tokens=16))
    )
    assert plan_prefill(capped.compressor.config, 8, 40).forward == "one-pass"
    with pytest.raises(ValueError, match="decode-time cap"):
        LayerByLayer(capped, None, torch.zeros(1, 40, dtype=torch.long))


def test_models_outside_the_supported_families_use_one_forward(caplog):
    other = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gemma3"))
    assert usable_slice(other, 256) == 0
    assert "gemma3" in caplog.text
    windowed = tiny_model("qwen2", seed=0)
    windowed.config.layer_types = ["sliding_attention", "full_attention"]
    assert usable_slice(windowed, 256) == 0
    assert usable_slice(tiny_model("mistral", seed=0), 256) == 256


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize(
    "method", ["none", "criticalkv-shares-kvzap", "criticalkv-layer-kvzip", "adakv-snapkv", "expected_attention"]
)
def test_engine_answers_and_kept_entries_are_those_of_one_forward(method, continuous, monkeypatch):
    requests = [Request("a", TEXT * 3, ["Who jumps?", "Why?"]), Request("b", TEXT, ["What?"])]
    results, calls = [], []
    counted = lambda *a: calls.append(a[-1].tokens) or layerwise_prefill(*a)  # noqa: E731
    monkeypatch.setattr(engine_prefill, "layerwise_prefill", counted)
    for tokens in (0, 16):
        loaded = tiny_loaded("llama")
        loaded.layerwise_prefill = tokens
        extra = {"kvzap_model": tiny_kvzap_file(loaded, KVZAP_DIR)} if "kvzap" in method else {}
        comp = CompressionConfig(method=method, cache_size=0.4, window=4, kernel=3, **extra)
        engine = Engine(loaded, comp, GenerationConfig(max_new_tokens=8, batch_size=2, continuous=continuous))
        assert engine.context_prefill.layer_slice == tokens
        answers = engine.generate(requests)
        results.append([(a.prediction, a.kv_entries_kept, a.error) for a in answers])
    assert results[0] == results[1]
    assert all(error is None for *_, error in results[0])
    assert calls == ([] if method in WHOLE_QUERIES else [16] * (1 if not continuous else 2))


def test_left_to_auto_it_slices_on_cpu_where_the_model_allows_and_says_nothing_elsewhere(tmp_path, caplog):
    """``layerwise_prefill`` unset: 1024-token slices on CPU for a supported family, one forward for
    another family (without the warning an explicit value gets) and wherever it is set to 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from pipeline.engine.config import ModelConfig
    from pipeline.engine.layerwise import AUTO_LAYERWISE_SLICE
    from pipeline.engine.loading import load_model
    from tests.engine.test_model_source import save_tiny
    from tests.tiny import tiny_tokenizer

    llama = save_tiny(tmp_path / "llama")
    loaded = load_model(ModelConfig(name=str(llama), device="cpu"))
    assert AUTO_LAYERWISE_SLICE == 1024 and loaded.layerwise_prefill == AUTO_LAYERWISE_SLICE
    assert load_model(ModelConfig(name=str(llama), device="cpu", layerwise_prefill=0)).layerwise_prefill == 0
    assert load_model(ModelConfig(name=str(llama), device="cpu", layerwise_prefill=256)).layerwise_prefill == 256
    tokenizer = tiny_tokenizer()
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=32, n_layer=1, n_head=2)
    ).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    caplog.clear()
    loaded = load_model(ModelConfig(name=str(gpt2), device="cpu"))
    assert loaded.layerwise_prefill == 0
    Engine(loaded, CompressionConfig(method="snapkv", cache_size=0.5, window=4), GenerationConfig(max_new_tokens=1))
    assert "ignored" not in caplog.text
