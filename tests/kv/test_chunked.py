"""Chunked prefill with real eviction (pipeline.kv.chunked) on tiny models.

* one chunk as long as the context keeps exactly the unchunked prefill's entries, for every method
  that can be chunked (batch 2, left padding);
* small chunks against a naive reference written here: one row alone, every chunk recomputed by a
  full forward in which each query sees its own chunk causally plus what the cache kept before its
  chunk, top-k of the raw scores at the final or the running budget with the recent window kept;
* the store never holds more than the budget after a chunk (the final one, or the running one);
* with the final budget, the first layer's kept set (its keys do not depend on the earlier chunks)
  is the one-pass prefill's, where the running budget loses early entries.
"""

import math

import pytest
import torch
from transformers import AttentionInterface

from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.prefill.rules import plan_prefill
from pipeline.kv.rope import model_rotary
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from tests.kv.reference import topk_indices
from tests.methods import COMPRESSING
from tests.tiny import DEVICE, tiny_kvzap_for, tiny_model

LENGTHS = (40, 31)  # row 1 is left padded in the one-pass batch
WINDOW = 3
CHUNKABLE = [m for m in COMPRESSING if not m.endswith("kvzip")]


def _compressor(model, method, cache_size, chunk=None, chunk_budget="final"):
    cfg = CompressionConfig(
        method=method,
        cache_size=cache_size,
        window=WINDOW,
        kernel=3,
        sink_tokens=2,
        prefill_chunk=chunk,
        chunk_budget=chunk_budget,
    )
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    priors = torch.rand(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.1
    return Compressor(cfg, priors, rotary=model_rotary(model), kvzap=tiny_kvzap_for(model, seed=4))


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).to(DEVICE) for n in LENGTHS]


def run_one_pass(model, compressor, rows):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), 258, dtype=torch.long, device=DEVICE)
    pos = torch.full((len(rows), width), -1, dtype=torch.long, device=DEVICE)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :], pos[b, width - len(r) :] = r, torch.arange(len(r), device=DEVICE)
    model.set_attn_implementation(register())
    cache = VarLenCache(model.config.num_hidden_layers, compressor)
    logits = run_chunk(model, cache, ids, pos).logits[:, -1]
    return cache, logits


def run_chunked(model, compressor, rows, chunk, after_chunk=None):
    """Positions [k*chunk, (k+1)*chunk) of every row per forward, compressing after each."""
    model.set_attn_implementation(register())
    cache = VarLenCache(model.config.num_hidden_layers, compressor)
    lengths = torch.tensor([len(r) for r in rows], device=DEVICE)
    last = [None] * len(rows)
    prefill = cache.begin_prefill(plan_prefill(compressor.config), lengths=lengths)
    for begin in range(0, int(lengths.max()), chunk):
        pieces = [r[begin : begin + chunk] for r in rows]
        width = max(len(p) for p in pieces)
        ids = torch.full((len(rows), width), 258, dtype=torch.long, device=DEVICE)
        pos = torch.full((len(rows), width), -1, dtype=torch.long, device=DEVICE)
        for b, p in enumerate(pieces):
            if len(p):
                ids[b, width - len(p) :] = p
                pos[b, width - len(p) :] = torch.arange(begin, begin + len(p), device=DEVICE)
        out = run_chunk(model, cache, ids, pos).logits[:, -1]
        prefill.after_forward(lengths.clamp(max=begin + chunk))
        for b in range(len(rows)):
            if begin < len(rows[b]) <= begin + chunk:
                last[b] = out[b]
        if after_chunk is not None:
            after_chunk(cache, lengths.clamp(max=begin + chunk))
    prefill.finish()
    return cache, torch.stack(last)


def _kept(cache, model, rows):
    heads = model.config.num_key_value_heads
    return [
        [[cache.kept_positions(layer, b, h).tolist() for h in range(heads)] for layer in range(len(cache.store))]
        for b in range(len(rows))
    ]


@pytest.mark.parametrize("method", CHUNKABLE)
def test_one_chunk_keeps_what_the_one_pass_prefill_keeps(method):
    model = tiny_model("llama", seed=1)
    rows = _rows(1)
    one, logits_one = run_one_pass(model, _compressor(model, method, 0.3), rows)
    chunked, logits_chunked = run_chunked(model, _compressor(model, method, 0.3, chunk=64), rows, 64)
    assert _kept(chunked, model, rows) == _kept(one, model, rows)
    torch.testing.assert_close(logits_chunked, logits_one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_budget", ["final", "running"])
@pytest.mark.parametrize("method", ["kvzap", "shares-kvzap", "criticalkv-adakv-snapkv", "layer-knorm"])
def test_store_stays_within_the_budget(method, chunk_budget):
    model = tiny_model("qwen3", seed=2, layers=3)
    rows = _rows(2)
    heads = model.config.num_key_value_heads

    def check(cache, seen):
        for b, n in enumerate(seen.tolist()):
            of = len(rows[b]) if chunk_budget == "final" else n
            pool = 3 * heads * max(1, round(0.25 * of))
            counts = [int(cache.store[layer].length[b * heads + h]) for layer in range(3) for h in range(heads)]
            assert sum(counts) <= pool + 3 * heads * WINDOW  # the window floor of each head at most
            assert max(counts) <= n

    run_chunked(model, _compressor(model, method, 0.25, chunk=8, chunk_budget=chunk_budget), rows, 8, check)


@pytest.mark.parametrize("chunk_budget", ["final", "running"])
@pytest.mark.parametrize("method", ["kvzap", "shares-kvzap"])
def test_final_budget_keeps_everything_until_a_head_is_full(method, chunk_budget):
    """Per-head counts fixed by the allocation: with the final budget, after every chunk a head holds
    min(its final count, what it held + the chunk's tokens); the running budget evicts earlier."""
    model = tiny_model("qwen3", seed=2, layers=3)
    rows = _rows(2)
    heads = model.config.num_key_value_heads
    history = []  # per chunk: (B,) tokens seen, (B, layers * heads) counts

    def record(cache, seen):
        counts = [
            [int(cache.store[layer].length[b * heads + h]) for layer in range(3) for h in range(heads)]
            for b in range(len(rows))
        ]
        history.append((seen.tolist(), counts))

    run_chunked(model, _compressor(model, method, 0.25, chunk=8, chunk_budget=chunk_budget), rows, 8, record)
    final = history[-1][1]
    seen_before, held_before = [0] * len(rows), [[0] * (3 * heads) for _ in rows]
    early = []
    for seen, counts in history:
        for b in range(len(rows)):
            new = seen[b] - seen_before[b]
            expected = [min(f, h + new) for f, h in zip(final[b], held_before[b])]
            early.append(counts[b] != expected)
            if chunk_budget == "final":
                assert counts[b] == expected
        seen_before, held_before = seen, counts
    assert any(early) == (chunk_budget == "running")


def test_between_chunks_only_the_store_and_one_layers_projection_are_held():
    """Nothing of an earlier chunk stays referenced beside the store: no chunk's values (recorded for
    the decode-time cap only, which a chunked prefill refuses) and the float32 W_O copy of one layer
    at most (a copy of every layer's would be held for the engine's life)."""
    model = tiny_model("llama", seed=3)
    compressor = _compressor(model, "criticalkv-shares-kvzap", 0.3, chunk=8)
    held = []

    def record(cache, seen):
        held.append((len(cache._appended), len(compressor._projections)))

    run_chunked(model, compressor, _rows(3), 8, record)
    assert held and all(values == 0 and projections == 1 for values, projections in held)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_final_budget_keeps_the_one_pass_first_layer(arch):
    """Layer 0's inputs are the token embeddings, so its kvzap scores depend on each token alone: with
    the final budget the chunked prefill keeps exactly the one-pass entries of that layer (an entry
    evicted after a chunk is outranked by a head's final count of entries, which the one pass sees
    too); the running budget loses early entries the one pass keeps."""
    model = tiny_model(arch, seed=6)
    rows = _rows(4)
    one, _ = run_one_pass(model, _compressor(model, "kvzap", 0.3), rows)
    final, _ = run_chunked(model, _compressor(model, "kvzap", 0.3, chunk=8), rows, 8)
    running, _ = run_chunked(model, _compressor(model, "kvzap", 0.3, chunk=8, chunk_budget="running"), rows, 8)
    first = [kept[0] for kept in _kept(one, model, rows)]
    assert [kept[0] for kept in _kept(final, model, rows)] == first
    assert [kept[0] for kept in _kept(running, model, rows)] != first


def chunked_reference(model, ids, chunk, cache_size, score_fn, chunk_budget):
    """One row alone, naive: kept[l][h] positions after the last chunk and the last logits.
    score_fn(keys (H, T, D), attention inputs (T, hidden), layer, begin) -> (H, T) raw scores."""
    n, layers = len(ids), model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    history, kept, held = [], None, None  # held[layer][head]: {position: raw score} of the kept entries
    for begin in range(0, n, chunk):
        end = min(n, begin + chunk)
        history.append(kept)
        keys, inputs, logits = _masked_forward(model, ids[:end], chunk, history)
        window = min(WINDOW, end)
        budget_of = n if chunk_budget == "final" else end
        budget = min(max(round(cache_size * budget_of), min(WINDOW, budget_of)), end)
        kept_now, held_now = [], []
        for layer in range(layers):
            raw = score_fn(keys[layer][:, begin:end], inputs[layer][begin:end], layer, begin)
            kept_layer, held_layer = [], []
            for h in range(heads):
                scores = {} if held is None else dict(held[layer][h])
                scores.update(zip(range(begin, end), raw[h].tolist()))
                candidates = sorted(scores)
                values = [math.inf if p >= end - window else scores[p] for p in candidates]
                chosen = sorted(candidates[i] for i in topk_indices(values, budget))
                kept_layer.append(chosen)
                held_layer.append({p: scores[p] for p in chosen})
            kept_now.append(kept_layer)
            held_now.append(held_layer)
        kept, held = kept_now, held_now
    return kept, logits


def _masked_forward(model, ids, chunk, history):
    """Full forward of ``ids``: query p sees key j <= p of its own chunk, or j kept before p's chunk."""
    n, g = len(ids), model.config.num_attention_heads // model.config.num_key_value_heads
    keys, inputs = {}, {}

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer, heads = module.layer_idx, key.shape[1]
        keys[layer] = key[0]
        allowed = torch.zeros(heads, n, n, dtype=torch.bool, device=key.device)
        for p in range(n):
            k = p // chunk
            allowed[:, p, k * chunk : p + 1] = True
            if history[k] is not None:
                for h in range(heads):
                    allowed[h, p, history[k][layer][h]] = True
        logits = (query @ key.repeat_interleave(g, 1).transpose(-1, -2)) * scaling
        logits = logits.masked_fill(~allowed.repeat_interleave(g, 0)[None], float("-inf"))
        out = torch.softmax(logits.float(), -1) @ value.repeat_interleave(g, 1)
        return out.transpose(1, 2).contiguous(), None

    def record(module, args, kwargs):
        inputs[module.layer_idx] = kwargs["hidden_states"][0]

    AttentionInterface.register("chunked_reference_test", attention)
    model.set_attn_implementation("chunked_reference_test")
    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True) for layer in model.model.layers]
    try:
        out = model(input_ids=ids[None], position_ids=torch.arange(n, device=ids.device)[None]).logits[0, -1]
    finally:
        for hook in hooks:
            hook.remove()
    return keys, inputs, out


# (qwen3 normalises its keys, so knorm's scores there are ties broken by rounding: not a test of anything)
@pytest.mark.parametrize("chunk_budget", ["final", "running"])
@pytest.mark.parametrize(
    "arch,method", [("llama", "kvzap"), ("qwen3", "kvzap"), ("llama", "knorm"), ("mistral", "knorm")]
)
def test_small_chunks_match_the_naive_reference(arch, method, chunk_budget):
    model = tiny_model(arch, seed=5)
    compressor = _compressor(model, method, 0.3, chunk=12, chunk_budget=chunk_budget)
    kvzap = compressor.kvzap

    def score_fn_for(total):  # a chunk's position terms read the whole row's length
        def score_fn(keys, hidden, layer, begin):
            if method == "knorm":
                return torch.softmax(-keys.float().norm(dim=-1) / keys.shape[-1] ** 0.5, dim=-1)
            positions = begin + torch.arange(hidden.shape[0], device=hidden.device)
            pred = kvzap.predict(layer, hidden[None], positions[None], torch.tensor([total]))[0].clamp(max=60).exp()
            return pred.masked_fill((positions < 2)[None], float("inf"))  # sink_tokens=2

        return score_fn

    rows = _rows(3)
    cache, logits = run_chunked(model, compressor, rows, 12)
    ours = _kept(cache, model, rows)
    for b, row in enumerate(rows):
        kept, ref_logits = chunked_reference(model, row, 12, 0.3, score_fn_for(len(row)), chunk_budget)
        assert ours[b] == kept
        torch.testing.assert_close(logits[b], ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["criticalkv-kvzap", "criticalkv-shares-kvzap", "criticalkv-adakv-snapkv"])
def test_held_entries_norms_are_reused_not_recomputed_and_change_nothing(method, monkeypatch):
    """CriticalKV needs the projected value norms of the candidates; a held entry's norm was computed
    when it was kept and its value has not changed since, so later chunks reuse it. The kept sets
    equal those of a run that forgets every norm after each chunk, with fewer norms computed."""
    from pipeline.kv.prefill import chunk_eviction as chunked

    model = tiny_model("llama", seed=3)
    rows = _rows(4)

    def run():
        compressor = _compressor(model, method, 0.3, chunk=8)
        cache, _ = run_chunked(model, compressor, rows, 8)
        return _kept(cache, model, rows), compressor.norm_stats.exact

    reused, computed_reused = run()
    original = chunked.kept_in_order

    def forget_norms(values, keep, fill="-inf"):
        moved = original(values, keep, fill)
        return moved.fill_(float("nan")) if fill == "nan" else moved

    monkeypatch.setattr(chunked, "kept_in_order", forget_norms)
    forgotten, computed_forgotten = run()
    assert reused == forgotten
    assert computed_reused < computed_forgotten
