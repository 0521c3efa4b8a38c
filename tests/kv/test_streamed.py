"""Cross-layer budgets streamed layer by layer (pipeline.kv.prefill.streamed_budgets) keep exactly what the
dense path keeps.

* every method that streams (a per-layer scorer, the ``layer`` allocation, a nested selection; taken
  from the registries) keeps, on a 4-layer tiny model at batch 2 with left padding, the positions that
  ``Compressor.compress_model`` chooses from every layer's dense K/V at once;
* no layer's dense K/V outlives its layer's compression; after every layer the store holds at most the final
  cache's entries per row (L * H_kv * b) plus one layer's, after the last exactly the final cache;
  earlier layers really shrink on the way (the test would pass vacuously otherwise);
* the allocation's prefix counts bound its final counts from above and equal them at the last layer;
* every selection declared ``nested`` chooses from its own larger choice what it chooses from all
  entries (random tensors, many budgets).
"""

import weakref

import pytest
import torch

from pipeline.kv.allocation import ALLOCATIONS
from pipeline.kv.allocation.layer import top_entries
from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor, PendingLayer
from pipeline.kv.config import CompressionConfig, method_name
from pipeline.kv.parts import LayerContext
from pipeline.kv.phases import Phase
from pipeline.kv.prefill.capture import CaptureCache
from pipeline.kv.prefill.rules import streams
from pipeline.kv.ranking import rank_desc
from pipeline.kv.rope import model_rotary
from pipeline.kv.scorers import SCORERS
from pipeline.kv.selection import SELECTIONS
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from pipeline.kv.value_norms import NormStats, OutputProjection
from tests.tiny import DEVICE, tiny_kvzap, tiny_kvzap_for, tiny_model

LAYERS, N, PAD = 4, 40, 9
STREAMING = [
    method_name(scorer, allocation=alloc, selection=sel)
    for scorer in SCORERS
    for alloc in ALLOCATIONS
    for sel in SELECTIONS
    if SCORERS[scorer].decides is Phase.LAYER and ALLOCATIONS[alloc].streams and SELECTIONS[sel].nested
]


def _compressor(model, method: str, cache_size: float) -> Compressor:
    cfg = CompressionConfig(method=method, cache_size=cache_size, window=3, kernel=3)
    kvzap = tiny_kvzap_for(model, seed=7) if cfg.needs_kvzap_model else None
    return Compressor(cfg, rotary=model_rotary(model), kvzap=kvzap)


def _batch(seed: int = 0):
    """ids, positions (2, N): the second row is PAD tokens shorter (left padded)."""
    ids = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    pos = torch.arange(N, device=DEVICE).expand(2, N).clone()
    pos[1, :PAD] = -1
    pos[1, PAD:] = torch.arange(N - PAD, device=DEVICE)
    return ids, pos


class _Watch:
    """Records the entries each row of ``cache`` holds after every layer's compression (wraps the layer
    step of its prefill; the watch refers to the store, not to the cache)."""

    def __init__(self, cache: VarLenCache) -> None:
        self.store = cache.store
        self.held: list[torch.Tensor] = []
        self.per_layer: list[list[int]] = []
        self.dense_keys: list[weakref.ref] = []
        self.outlived = 0  # earlier layers' dense K/V alive after a later layer's compression
        step = cache.prefill.layers
        add, step_ref = type(step).add, weakref.ref(step)  # no cycle through the step: the cache must go at once

        def watched_add(idx, *args) -> None:
            self.dense_keys.append(weakref.ref(args[2]))  # (module, observed, key, value, key_pos, scaling)
            add(step_ref(), idx, *args)
            # earlier layers' attention calls have returned: nothing may hold their dense K/V (no cycles: refcounts)
            self.outlived += sum(ref() is not None for ref in self.dense_keys[:-1])
            stored = [layer for layer in self.store if layer is not None]
            self.held.append(sum(layer.entries_per_row() for layer in stored))
            self.per_layer.append([int(layer.entries_per_row().sum()) for layer in stored])

        step.add = watched_add


def test_the_streaming_methods_are_the_cross_layer_ones_with_a_per_layer_scorer():
    assert "criticalkv-layer-kvzap" in STREAMING and "layer-knorm" in STREAMING
    assert not any("kvzip" in m for m in STREAMING)
    model = tiny_model("llama", layers=LAYERS)
    for method in STREAMING:
        assert streams(_compressor(model, method, 0.2).config), method
    idle = VarLenCache(LAYERS, _compressor(model, "criticalkv-layer-kvzap", 0.2))  # as rows regrouped for decoding
    gone = weakref.ref(idle)
    del idle  # it holds no streaming state, so no cycle through it: refcounting frees it at once
    assert gone() is None
    capped = CompressionConfig(method="layer-snapkv", cache_size=0.2, window=2, max_cache_tokens=12)
    assert not streams(capped)  # the decode-time cap starts from one selection


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", STREAMING)
@pytest.mark.parametrize("cache_size", [0.2, 0.5])
def test_streamed_keeps_what_the_dense_cache_keeps(arch, method, cache_size):
    model = tiny_model(arch, seed=2, layers=LAYERS)
    model.set_attn_implementation(register())
    compressor = _compressor(model, method, cache_size)
    ids, pos = _batch()
    capture = CaptureCache(LAYERS, [compressor])
    run_chunk(model, capture, ids, pos)
    dense = compressor.compress_model(
        [PendingLayer(c.module, c.key, c.value, c.key_pos, c.scaling, c.observed[0]) for c in capture.captured]
    )
    cache = VarLenCache(LAYERS, compressor)
    watch = _Watch(cache)
    with torch.no_grad():  # as the engine runs (autograd would keep the dense K/V in its graph)
        run_chunk(model, cache, ids, pos)
    assert cache.prefill is None  # the prefill's state (its scores, its reference back) is gone
    heads = model.config.num_key_value_heads
    for layer, selection in enumerate(dense):
        for b in range(2):
            for h in range(heads):
                want = pos[b][selection.keep[b, h]].tolist()
                assert cache.kept_positions(layer, b, h).tolist() == sorted(want), (layer, b, h)
    lengths = (pos >= 0).sum(-1)
    pool = torch.round(lengths.double() * cache_size).long() * LAYERS * heads
    slack = heads * lengths  # one layer's entries: earlier layers shrink in batches (streamed_budgets)
    assert all(bool((held <= pool + slack).all()) for held in watch.held)
    assert bool((watch.held[-1] <= pool).all())
    assert torch.equal(watch.held[-1], cache.context_entries)
    shrank = any(
        after < before for prev, cur in zip(watch.per_layer, watch.per_layer[1:]) for before, after in zip(prev, cur)
    )
    assert shrank, "no earlier layer shrank: the test does not exercise the streaming"
    assert watch.outlived == 0, "a layer's dense K/V outlived its layer"
    gone = weakref.ref(cache)
    del cache  # no reference cycle left: refcounting alone frees the cache (and its store) at once
    assert gone() is None


def _scores(layers: int, heads: int, n: int, seed: int) -> list[torch.Tensor]:
    """Per layer (2, heads, n) scores: row 1 left padded (-inf), the last 2 tokens a window (+inf)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        s = torch.randn(2, heads, n, generator=g).exp()
        s[1, :, :PAD] = float("-inf")
        s[:, :, -2:] = float("inf")
        out.append(s)
    return out


@pytest.mark.parametrize("name", [a for a in ALLOCATIONS if ALLOCATIONS[a].streams])
@pytest.mark.parametrize("seed", range(5))
def test_prefix_counts_bound_the_final_counts(name, seed):
    allocation = ALLOCATIONS[name]
    layers, heads, n = 5, 3, 30
    scores = _scores(layers, heads, n, seed)
    budget = torch.tensor([6, 4])
    kvzap = tiny_kvzap(layers, heads, 8, seed) if allocation.needs_kvzap_model else None
    lengths, window = torch.tensor([n, n - PAD]), torch.tensor([2, 2])
    contexts = [
        LayerContext(i, None, None, None, 1.0, lengths, budget, window, None, None, kvzap=kvzap) for i in range(layers)
    ]
    options = allocation.options_from(CompressionConfig(method=method_name("snapkv", allocation=name), cache_size=0.2))
    final = allocation.model_head_budgets(scores, contexts, options)
    for seen in range(1, layers + 1):
        prefix = allocation.prefix_head_budgets(scores[:seen], contexts[:seen], layers, options)
        assert all(bool((p >= f).all()) for p, f in zip(prefix, final))
        assert bool((sum(p.sum(-1) for p in prefix) <= budget * layers * heads).all())
    assert all(torch.equal(p, f) for p, f in zip(prefix, final))


@pytest.mark.parametrize("name", [s for s in SELECTIONS if SELECTIONS[s].nested])
@pytest.mark.parametrize("seed", range(4))
def test_a_nested_selection_chooses_from_its_own_choice_what_it_chooses_from_all(name, seed):
    selection = SELECTIONS[name]
    cfg = CompressionConfig(method=method_name("snapkv", selection=name), cache_size=0.5, window=2)
    options = selection.options_from(cfg)
    g = torch.Generator().manual_seed(seed)
    heads, n, dim, hidden = 2, 30, 8, 16
    scores = _scores(1, heads, n, seed)[0]
    value = torch.randn(2, heads, n, dim, generator=g)
    proj = OutputProjection.from_weight(torch.randn(hidden, 2 * heads * dim, generator=g), heads, dim)
    window = torch.tensor([2, 2])

    def choose(s, budget):
        ctx = LayerContext(0, None, value, None, 1.0, None, None, window, None, lambda: proj)
        return selection.select(s, budget, ctx, options, NormStats())[0]

    for big in range(2, n - PAD + 1, 3):
        larger = choose(scores, torch.full((2, heads), big))
        for small in range(0, big + 1, 2):
            want = choose(scores, torch.full((2, heads), small))
            got = choose(scores.masked_fill(~larger, float("-inf")), torch.full((2, heads), small))
            assert torch.equal(got, want), (big, small)


@pytest.mark.parametrize("seed", range(6))
def test_top_entries_keeps_what_a_full_ranking_keeps(seed):
    """The layer allocation's top-k without a full sort, on scores full of ties, +inf and -inf."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, 6, (3, 200), generator=g).float()
    flat[flat == 0] = float("-inf")
    flat[flat == 5] = float("inf")
    valid = flat > float("-inf")
    k = torch.randint(0, 240, (3,), generator=g)  # some beyond the row's valid entries
    want = (rank_desc(flat) < k[:, None]) & valid
    assert torch.equal(top_entries(flat, k), want)
