"""When each method decides (pipeline.kv.phases): declared by the parts, run by the cache and the engine.

A method decides at the latest of its parts' phases; the cache then holds at most one layer's
dense K/V (LAYER, and PREFILL methods that stream across layers), every layer's until the prefill
forward's last attention (PREFILL otherwise), or every layer's until the engine brings the
reconstruction scores (PASSES).
"""

import pytest
import torch

from pipeline.kv.allocation import ALLOCATIONS
from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.phases import Phase, method_phase
from pipeline.kv.scorers import SCORERS
from pipeline.kv.selection import SELECTIONS
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from tests.tiny import DEVICE, tiny_model

LAYERS = 3


def test_every_part_declares_a_phase():
    for registry in (SCORERS, ALLOCATIONS, SELECTIONS):
        for name in registry:
            assert isinstance(registry[name].decides, Phase), name
    assert SCORERS["kvzip"].decides is Phase.PASSES
    assert ALLOCATIONS["layer"].decides is Phase.PREFILL


@pytest.mark.parametrize(
    "method, size, phase",
    [
        ("criticalkv-adakv-snapkv", 0.2, Phase.LAYER),
        ("layer-snapkv", 0.2, Phase.PREFILL),
        ("kvzip", 0.2, Phase.PASSES),
        ("layer-kvzip", 0.2, Phase.PASSES),  # the latest part decides
        ("layer-kvzip", 1.0, Phase.LAYER),  # keeps the full cache: nothing waits
    ],
)
def test_method_phase_is_the_latest_of_its_parts(method, size, phase):
    cfg = CompressionConfig(method=method, cache_size=size)
    assert cfg.phase is phase
    assert Compressor(cfg).phase is phase
    if cfg.compresses:
        assert method_phase(cfg.parts()) is phase


def _watched(cache: VarLenCache) -> list[int]:
    """Records, after each layer's attention, how many layers' dense K/V the cache's prefill holds."""
    held: list[int] = []
    step = cache.prefill.layers
    add = step.add

    def watched_add(idx, *args) -> None:
        add(idx, *args)
        held.append(sum(layer is not None for layer in getattr(step, "pending", [])))

    step.add = watched_add
    return held


@pytest.mark.parametrize(
    "method, knobs, held, awaiting",
    [
        ("snapkv", {}, [0, 0, 0], False),  # LAYER: each layer compressed after its own attention
        # PREFILL with a per-layer scorer: streamed (each layer compressed as it comes, kv.prefill.streamed_budgets)
        ("layer-snapkv", {}, [0, 0, 0], False),
        # PREFILL under the decode-time cap: compressed after the last layer's attention
        ("layer-snapkv", {"max_cache_tokens": 12}, [1, 2, 0], False),
        ("layer-kvzip", {}, [1, 2, 3], True),  # PASSES: everything waits for the engine
    ],
)
def test_the_cache_runs_each_phase_at_its_moment(method, knobs, held, awaiting):
    model = tiny_model("llama", layers=LAYERS)
    model.set_attn_implementation(register())
    cache = VarLenCache(LAYERS, Compressor(CompressionConfig(method=method, cache_size=0.3, window=2, **knobs)))
    held_after_each_layer = _watched(cache)
    ids = torch.randint(0, 200, (2, 20), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    pos = torch.arange(20, device=DEVICE).expand(2, 20).clone()
    pos[1, :5] = -1  # the second row is left padded
    run_chunk(model, cache, ids, pos)
    assert held_after_each_layer == held
    assert (cache.prefill is not None and cache.prefill.awaiting_passes is not None) is awaiting
    assert all(layer is not None for layer in cache.store) is not awaiting


def test_a_chunked_prefill_refuses_a_passes_method():
    with pytest.raises(ValueError, match="prefill_chunk"):
        CompressionConfig(method="layer-kvzip", cache_size=0.2, prefill_chunk=8)
