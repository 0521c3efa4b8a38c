"""Compressed cache vs full cache on tiny models.

* cache_size=1.0 with any method gives exactly the full-cache logits (1e-5);
* at 0.2 / 0.5 the compressed cache's question + decode logits equal a full-cache run (plain
  transformers DynamicCache and a naive eager attention written here) in which the evicted
  entries of each (layer, head) are masked out (1e-4);
* memory accounting equals the storage of the tensors really held;
* the decode-time cap bounds every head and never evicts the recent window.
"""

import json

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from pipeline.config import METHODS, CompressionConfig
from pipeline.kv.attention import register
from pipeline.kv.cache import VarLenCache
from pipeline.kv.compress import Compressor
from tests.tiny import DEVICE, tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "llama-mha"]
N_CTX, N_Q, N_DEC = 48, 5, 4


@pytest.fixture(scope="module")
def priors_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("priors") / "heads.json"
    path.write_text(json.dumps({"scores": [[0.9, 0.1, 0.5, 0.2, 0.7, 0.3], [0.2, 0.8, 0.1, 0.4, 0.6, 0.3]]}))
    return path


def _config(method, cache_size, priors_file, **kw):
    extra = {"head_priors": priors_file} if "headkv" in method else {}
    return CompressionConfig(method=method, cache_size=cache_size, window=4, kernel=3, **extra, **kw)


def _compressor(cfg, model):
    priors = None
    if cfg.head_priors is not None:
        from pipeline.engine.engine import load_head_priors

        priors = load_head_priors(cfg.head_priors, model.config.num_hidden_layers, model.config.num_key_value_heads)
    return Compressor(cfg, priors)


def run_ours(model, cfg, ctx_ids, q_ids, dec_ids):
    """Prefill ctx through VarLenCache, then question and decode tokens; returns (logits, cache)."""
    model.set_attn_implementation(register())
    cache = VarLenCache(model.config.num_hidden_layers, _compressor(cfg, model))
    outs = []
    start = 0
    for chunk in (ctx_ids, q_ids, *[d[None] for d in dec_ids]):
        if chunk.numel() == 0:
            continue
        pos = torch.arange(start, start + chunk.shape[-1], device=DEVICE)[None]
        cache.begin_chunk(pos)
        out = model(input_ids=chunk.view(1, -1), position_ids=pos, cache=cache, varlen_cache=cache, use_cache=True)
        outs.append(out.logits[0])
        start += chunk.shape[-1]
    return (torch.cat(outs[1:]) if len(outs) > 1 else None), cache


def masked_reference(model, ctx_ids, q_ids, dec_ids, keep):
    """Full DynamicCache run; context key j of (layer, head) visible only if keep[layer][head, j]."""

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        t, total = query.shape[2], key.shape[2]
        logits = (query @ k.transpose(-1, -2)) * scaling
        q_pos = torch.arange(total - t, total, device=query.device)
        allowed = torch.arange(total, device=query.device)[None, :] <= q_pos[:, None]  # causal
        allowed = allowed[None].repeat(query.shape[1], 1, 1)
        if total > N_CTX or t < total:  # after the prefill: evicted context entries are invisible
            mask = keep[module.layer_idx].repeat_interleave(groups, dim=0)  # (H_q, N_CTX)
            allowed[:, :, :N_CTX] &= mask[:, None, :]
        logits = logits.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(logits.float(), -1)
        return (probs @ v).transpose(1, 2).contiguous(), None

    AttentionInterface.register("masked_reference_test", attention)
    model.set_attn_implementation("masked_reference_test")
    cache = DynamicCache(config=model.config)
    outs = []
    start = 0
    for chunk in (ctx_ids, q_ids, *[d[None] for d in dec_ids]):
        pos = torch.arange(start, start + chunk.shape[-1], device=DEVICE)[None]
        outs.append(model(input_ids=chunk.view(1, -1), position_ids=pos, cache=cache, use_cache=True).logits[0])
        start += chunk.shape[-1]
    return torch.cat(outs[1:])


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (N_CTX,), generator=g).to(DEVICE),
        torch.randint(0, 256, (N_Q,), generator=g).to(DEVICE),
        torch.randint(0, 256, (N_DEC,), generator=g).to(DEVICE),
    )


def _keep_masks(cache, model):
    masks = []
    for layer in range(model.config.num_hidden_layers):
        heads = model.config.num_key_value_heads
        m = torch.zeros(heads, N_CTX, dtype=torch.bool, device=DEVICE)
        for h in range(heads):
            pos = cache.kept_positions(layer, 0, h)
            m[h, pos[pos < N_CTX].long()] = True
        masks.append(m)
    return masks


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
def test_full_budget_equals_full_cache(arch, method, priors_file):
    if "headkv" in method and arch == "llama-mha":
        pytest.skip("priors file gives 6 scores per layer, which do not group into 4 KV heads")
    model = tiny_model(arch)
    ctx, q, dec = _inputs(1)
    ours, cache = run_ours(model, _config(method, 1.0, priors_file), ctx, q, dec)
    ref = masked_reference(model, ctx, q, dec, [torch.ones(model.config.num_key_value_heads, N_CTX, dtype=torch.bool, device=DEVICE)] * 2)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    model.set_attn_implementation("sdpa")
    plain = model(input_ids=torch.cat([ctx, q, dec])[None]).logits[0, N_CTX:]
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
@pytest.mark.parametrize("cache_size", [0.2, 0.5])
def test_compressed_equals_masked_full_cache(arch, method, cache_size, priors_file):
    if "headkv" in method and arch == "llama-mha":
        pytest.skip("priors file gives 6 scores per layer, which do not group into 4 KV heads")
    model = tiny_model(arch, seed=3)
    ctx, q, dec = _inputs(2)
    ours, cache = run_ours(model, _config(method, cache_size, priors_file), ctx, q, dec)
    keep = _keep_masks(cache, model)
    kept_fraction = sum(int(m.sum()) for m in keep) / sum(m.numel() for m in keep)
    assert kept_fraction == pytest.approx(cache_size, abs=0.03)
    ref = masked_reference(model, ctx, q, dec, keep)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # and compression really changed something: the full cache gives different logits
    full = masked_reference(model, ctx, q, dec, [torch.ones_like(m) for m in keep])
    assert not torch.allclose(ours, full, atol=1e-3)


def test_bytes_accounting_matches_storage(priors_file):
    model = tiny_model("llama")
    ctx, q, dec = _inputs(4)
    for method in ["criticalkv-snapkv", "criticalkv-adakv-snapkv", "none"]:
        _, cache = run_ours(model, _config(method, 0.25, priors_file), ctx, q[:0], dec[:0])
        real = sum(
            t.untyped_storage().nbytes()
            for layer in cache.store
            for t in (layer.keys, layer.values, layer.positions, layer.start, layer.length, layer.capacity)
        )
        assert int(cache.context_bytes.sum()) == real == cache.nbytes()
        entries = int(cache.context_entries.sum())
        assert layer_entries(cache) == entries
        per_entry = 2 * 16 * 4 + 4
        if method != "none":
            assert entries <= 0.26 * N_CTX * 2 * 2
            assert real < 0.3 * N_CTX * 2 * 2 * per_entry


def layer_entries(cache):
    return sum(int(layer.keys.shape[0]) for layer in cache.store)


def test_adakv_cache_is_ragged_not_padded(priors_file):
    model = tiny_model("mistral", seed=5)
    ctx, q, dec = _inputs(5)
    _, cache = run_ours(model, _config("criticalkv-adakv-snapkv", 0.3, priors_file, alpha_safeguard=0.1), ctx, q[:0], dec[:0])
    lengths = torch.cat([layer.length for layer in cache.store])
    assert lengths.min() < lengths.max()  # heads really keep different counts
    assert layer_entries(cache) == int(lengths.sum())  # storage holds exactly the kept entries


def test_decode_cap_bounds_cache_and_keeps_window(priors_file):
    model = tiny_model("llama", seed=6)
    ctx, q, _ = _inputs(6)
    dec = torch.randint(0, 256, (20,)).to(DEVICE)
    cap = 20
    cfg = _config("criticalkv-snapkv", 0.3, priors_file, max_cache_tokens=cap)
    _, cache = run_ours(model, cfg, ctx, q, dec)
    last = N_CTX + N_Q + len(dec) - 1
    for layer in cache.store:
        assert int(layer.length.max()) <= cap
        for h in range(layer.num_heads):
            held = set(layer.segment_positions(0, h).tolist())
            assert set(range(last - cfg.window + 1, last + 1)) <= held
