"""Compressed cache vs full cache on tiny models, for every method the part registries allow.

* cache_size=1.0 with any method gives exactly the full-cache logits (1e-5);
* at 0.2 / 0.5 the compressed cache's question + decode logits, for a batch of two left-padded
  rows, equal a full-cache run of each row alone (plain transformers DynamicCache and a naive
  eager attention written here) in which the evicted entries of each (layer, head) are masked
  out (1e-4);
* memory accounting equals the storage of the tensors really held;
* the decode-time cap bounds every head and never evicts the recent window.

The method matrix comes from the registries (``tests/methods.py``): every combination on two
architectures, and one method per part on every other architecture, so a new part is tested
here without editing this file.
"""

import json

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from pipeline.engine.priors import load_head_priors
from pipeline.engine.prompts import PromptBuilder
from pipeline.engine.reconstruction import ContextReconstruction
from pipeline.kv.attention.registered import cache_keyword, register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.rope import model_rotary
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from tests.methods import ALL_METHODS, COMPRESSING, one_method_per_part
from tests.tiny import DEVICE, tiny_kvzap_for, tiny_model, tiny_tokenizer

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "llama-mha"]
FULL_MATRIX_ARCHS = ["llama", "qwen3"]
N_CTX, N_Q, N_DEC = 48, 5, 4
PAD = 11  # the second row of a batch is this much shorter (left padded)


CASES = [(arch, m) for arch in FULL_MATRIX_ARCHS for m in COMPRESSING]
CASES += [(arch, m) for arch in ARCHS if arch not in FULL_MATRIX_ARCHS for m in one_method_per_part()]


def _priors_file(model, tmp_path) -> str:
    cfg = model.config
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(cfg.num_hidden_layers, cfg.num_key_value_heads, generator=g).add(0.05).tolist()
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"scores": scores}))
    return str(path)


def _compressor(model, method, cache_size, tmp_path, **kw) -> Compressor:
    cfg = CompressionConfig(method=method, cache_size=cache_size, window=4, kernel=3, **kw)
    priors = None
    if cfg.needs_head_priors:
        path = _priors_file(model, tmp_path)
        priors = load_head_priors(path, model.config.num_hidden_layers, model.config.num_key_value_heads)
    kvzap = tiny_kvzap_for(model, seed=7) if cfg.needs_kvzap_model else None
    return Compressor(cfg, priors, rotary=model_rotary(model), kvzap=kvzap)


def _inputs(seed=0, batch=2):
    """Per row: (context, question, decode tokens); row b's context is ``b * PAD`` tokens shorter."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        rows.append(tuple(torch.randint(0, 256, (n,), generator=g).to(DEVICE) for n in (N_CTX - b * PAD, N_Q, N_DEC)))
    return rows


def run_ours(model, compressor, rows):
    """Left-padded batched prefill through VarLenCache, then question and decode tokens (same lengths
    for every row). Returns (per-row logits (T, V) of the question and decode tokens, cache)."""
    model.set_attn_implementation(register())
    cache = VarLenCache(model.config.num_hidden_layers, compressor)
    width = max(r[0].numel() for r in rows)
    ids = torch.full((len(rows), width), 258, dtype=torch.long, device=DEVICE)
    pos = torch.full((len(rows), width), -1, dtype=torch.long, device=DEVICE)
    for b, (ctx, _, _) in enumerate(rows):
        ids[b, width - ctx.numel() :] = ctx
        pos[b, width - ctx.numel() :] = torch.arange(ctx.numel(), device=DEVICE)
    run_chunk(model, cache, ids, pos)
    held = cache.prefill.awaiting_passes if cache.prefill is not None else None
    if held is not None:  # KVzip: the passes, as the engine runs them
        cfg = compressor.config
        passes = ContextReconstruction(model, PromptBuilder(tiny_tokenizer()), 258, DEVICE)
        contexts = [r[0].tolist() for r in rows]
        cache.prefill.finish(passes.scores(contexts, [0] * len(rows), held, cfg.reconstruction_chunk, cfg.kvzip_plus))
    lengths = torch.tensor([r[0].numel() for r in rows], device=DEVICE)
    chunks = [torch.stack([r[1] for r in rows])] + [torch.stack([r[2][i : i + 1] for r in rows]) for i in range(N_DEC)]
    outs, start = [], lengths
    for chunk in chunks:
        chunk_pos = start[:, None] + torch.arange(chunk.shape[1], device=DEVICE)[None]
        outs.append(run_chunk(model, cache, chunk, chunk_pos).logits)
        start = start + chunk.shape[1]
    return torch.cat(outs, dim=1), cache


def masked_reference(model, ctx_ids, q_ids, dec_ids, keep):
    """Full DynamicCache run of one unpadded row.

    Context key j of (layer, head) is visible only if keep[layer][head, j].
    """
    n_ctx = ctx_ids.numel()

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        t, total = query.shape[2], key.shape[2]
        logits = (query @ k.transpose(-1, -2)) * scaling
        q_pos = torch.arange(total - t, total, device=query.device)
        allowed = torch.arange(total, device=query.device)[None, :] <= q_pos[:, None]  # causal
        allowed = allowed[None].repeat(query.shape[1], 1, 1)
        if total > n_ctx or t < total:  # after the prefill: evicted context entries are invisible
            mask = keep[module.layer_idx].repeat_interleave(groups, dim=0)  # (H_q, n_ctx)
            allowed[:, :, :n_ctx] &= mask[:, None, :]
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
        out = model(input_ids=chunk.view(1, -1), position_ids=pos, use_cache=True, **{cache_keyword(model): cache})
        outs.append(out.logits[0])
        start += chunk.shape[-1]
    return torch.cat(outs[1:])


def _keep_masks(cache, model, row, n_ctx):
    masks = []
    for layer in range(model.config.num_hidden_layers):
        heads = model.config.num_key_value_heads
        m = torch.zeros(heads, n_ctx, dtype=torch.bool, device=DEVICE)
        for h in range(heads):
            pos = cache.kept_positions(layer, row, h)
            m[h, pos[pos < n_ctx].long()] = True
        masks.append(m)
    return masks


def _full(model, n_ctx):
    return [
        torch.ones(model.config.num_key_value_heads, n_ctx, dtype=torch.bool, device=DEVICE)
    ] * model.config.num_hidden_layers


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_full_budget_equals_full_cache(arch, method, tmp_path):
    model = tiny_model(arch)
    rows = _inputs(1)
    ours, _ = run_ours(model, _compressor(model, method, 1.0, tmp_path), rows)
    for b, (ctx, q, dec) in enumerate(rows):
        ref = masked_reference(model, ctx, q, dec, _full(model, ctx.numel()))
        torch.testing.assert_close(ours[b], ref, rtol=1e-5, atol=1e-5)
    model.set_attn_implementation("sdpa")
    ctx, q, dec = rows[0]
    plain = model(input_ids=torch.cat([ctx, q, dec])[None]).logits[0, ctx.numel() :]
    torch.testing.assert_close(ours[0], plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,method", CASES)
@pytest.mark.parametrize("cache_size", [0.2, 0.5])
def test_compressed_equals_masked_full_cache(arch, method, cache_size, tmp_path):
    model = tiny_model(arch, seed=3)
    rows = _inputs(2)
    ours, cache = run_ours(model, _compressor(model, method, cache_size, tmp_path), rows)
    for b, (ctx, q, dec) in enumerate(rows):
        keep = _keep_masks(cache, model, b, ctx.numel())
        budget = min(max(round(ctx.numel() * cache_size), 1), ctx.numel())  # per head, of this row's own length
        heads = sum(m.shape[0] for m in keep)
        kept = sum(int(m.sum()) for m in keep)
        # exactly heads * budget, except HeadKV: rounding down and raising to the window move it by < 1 per head
        assert abs(kept - heads * budget) <= heads
        ref = masked_reference(model, ctx, q, dec, keep)
        torch.testing.assert_close(ours[b], ref, rtol=1e-4, atol=1e-4)
        # and compression really changed something: the full cache gives different logits
        full = masked_reference(model, ctx, q, dec, _full(model, ctx.numel()))
        assert not torch.allclose(ours[b], full, atol=1e-3)


def test_bytes_accounting_matches_storage(tmp_path):
    model = tiny_model("llama")
    rows = [r[:1] + (r[1][:0], r[2][:0]) for r in _inputs(4, batch=1)]
    for method in ["criticalkv-snapkv", "criticalkv-adakv-snapkv", "none"]:
        compressor = _compressor(model, method, 0.25, tmp_path)
        model.set_attn_implementation(register())
        cache = VarLenCache(model.config.num_hidden_layers, compressor)
        run_chunk(model, cache, rows[0][0][None], torch.arange(N_CTX, device=DEVICE)[None])
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


def test_adakv_cache_is_ragged_not_padded(tmp_path):
    model = tiny_model("mistral", seed=5)
    compressor = _compressor(model, "criticalkv-adakv-snapkv", 0.3, tmp_path, alpha_safeguard=0.1)
    _, cache = run_ours(model, compressor, _inputs(5))
    lengths = torch.cat([layer.length for layer in cache.store])
    assert lengths.min() < lengths.max()  # heads really keep different counts
    assert layer_entries(cache) >= int(lengths.sum())  # storage holds the kept entries (plus reserved room)


def test_decode_cap_bounds_cache_and_keeps_window(tmp_path):
    model = tiny_model("llama", seed=6)
    g = torch.Generator().manual_seed(6)
    ctx, q, dec = (torch.randint(0, 256, (n,), generator=g).to(DEVICE) for n in (N_CTX, N_Q, 20))
    cap = 20
    compressor = _compressor(model, "criticalkv-snapkv", 0.3, tmp_path, max_cache_tokens=cap)
    model.set_attn_implementation(register())
    cache = VarLenCache(model.config.num_hidden_layers, compressor)
    start = 0
    for chunk in (ctx, q, *[d[None] for d in dec]):
        pos = torch.arange(start, start + chunk.numel(), device=DEVICE)[None]
        run_chunk(model, cache, chunk.view(1, -1), pos)
        start += chunk.numel()
    last = start - 1
    for layer in cache.store:
        assert int(layer.length.max()) <= cap
        for h in range(layer.num_heads):
            held = set(layer.segment_positions(0, h).tolist())
            assert set(range(last - compressor.config.window + 1, last + 1)) <= held
    # the cap gives every decode step's entries their norms: every layer's W_O copy stays
    assert sorted(compressor._projections) == list(range(model.config.num_hidden_layers))
