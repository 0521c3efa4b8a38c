"""Rows leaving and joining a cache (pipeline.kv.storage.rows) against a naive reference: every segment as a
Python list of (key, value, position) entries, on random ragged layers with spare capacity."""

import pytest
import torch

from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.storage.cache import VarLenCache
from pipeline.kv.storage.rows import regroup, take_rows
from pipeline.kv.storage.store import VarLenLayer

HEADS, DIM = 2, 4


def random_layer(rows: int, seed: int) -> VarLenLayer:
    """A ragged layer whose segments hold 0-6 entries in a room of up to 3 more (not block aligned)."""
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(0, 7, (rows * HEADS,), generator=g)
    capacity = length + torch.randint(0, 4, (rows * HEADS,), generator=g)
    start = torch.cumsum(capacity, 0) - capacity
    total = int(capacity.sum())
    keys, values = torch.randn(total, DIM, generator=g), torch.randn(total, DIM, generator=g)
    positions = torch.randint(0, 100, (total,), generator=g, dtype=torch.int32)
    return VarLenLayer(keys, values, positions, start, length, capacity, rows, HEADS)


def segments(layer: VarLenLayer) -> list[list[tuple]]:
    """Naive read-back: per segment its live entries, in order."""
    out = []
    for s in range(layer.num_segments):
        begin = int(layer.start[s])
        out.append(
            [
                (layer.keys[i].tolist(), layer.values[i].tolist(), int(layer.positions[i]))
                for i in range(begin, begin + int(layer.length[s]))
            ]
        )
    return out


@pytest.mark.parametrize("seed", range(4))
def test_take_rows_copies_the_chosen_rows_in_order_with_their_room(seed):
    layer = random_layer(5, seed)
    original = segments(layer)
    rows = [3, 0, 4]
    taken = take_rows(layer, rows)
    expected = [original[r * HEADS + h] for r in rows for h in range(HEADS)]
    assert segments(taken) == expected
    assert taken.capacity.tolist() == [int(layer.capacity[r * HEADS + h]) for r in rows for h in range(HEADS)]
    assert taken.keys.shape[0] == int(taken.capacity.sum())  # the room moves with the row, nothing more


def test_take_rows_keeps_a_prefix_of_each_segment():
    layer = random_layer(3, 7)
    original = segments(layer)
    prefix = torch.tensor([min(2, len(original[2 * HEADS + h])) for h in range(HEADS)])
    taken = take_rows(layer, [2], prefix)
    assert segments(taken) == [original[2 * HEADS + h][: int(prefix[h])] for h in range(HEADS)]
    with pytest.raises(ValueError, match="more entries than a segment holds"):
        take_rows(layer, [2], prefix + 10)


def _cache(layers):
    cache = VarLenCache(len(layers), Compressor(CompressionConfig()))
    cache.store = list(layers)
    return cache


def _with_statistics(layer: VarLenLayer, seed: int) -> VarLenLayer:
    """``layer`` with random decode-cap statistics on every slot (indexed like its keys)."""
    g = torch.Generator().manual_seed(seed)
    layer.acc_attention = torch.rand(layer.keys.shape[0], generator=g)
    layer.value_norm = torch.rand(layer.keys.shape[0], generator=g)
    return layer


def entry_statistics(layer: VarLenLayer) -> list[list[tuple[float, float]]]:
    """Naive read-back of the cap statistics: per segment, its live entries' (accumulated, norm)."""
    out = []
    for s in range(layer.num_segments):
        begin = int(layer.start[s])
        live = range(begin, begin + int(layer.length[s]))
        out.append([(float(layer.acc_attention[i]), float(layer.value_norm[i])) for i in live])
    return out


@pytest.mark.parametrize("capped", [False, True])
def test_regroup_keeps_rows_then_appends_the_joining_caches(capped):
    """Kept rows, then the joining caches' rows; under a decode-time cap each entry's statistics move
    and join with it."""
    stats = _with_statistics if capped else (lambda layer, seed: layer)
    read = entry_statistics if capped else segments
    cache = _cache([stats(random_layer(4, 1), 1), stats(random_layer(4, 2), 2)])
    other = _cache([stats(random_layer(2, 3), 3), stats(random_layer(2, 4), 4)])
    before = [read(layer) for layer in cache.store]
    joining = [read(layer) for layer in other.store]
    regroup(cache, [2, 1], [other])
    for idx in range(2):
        keep = [before[idx][r * HEADS + h] for r in (2, 1) for h in range(HEADS)]
        assert read(cache.store[idx]) == keep + joining[idx]
        assert cache.store[idx].num_rows == 4
        assert other.store[idx] is None  # released as it was copied
        if capped:
            assert cache.store[idx].acc_attention.shape == cache.store[idx].keys.shape[:1]


def test_the_decode_caps_statistics_move_with_a_prefix_and_must_match_to_join():
    layer = _with_statistics(random_layer(4, 8), 1)
    before = entry_statistics(layer)
    prefix = torch.tensor([min(1, len(before[1 * HEADS + h])) for h in range(HEADS)])
    taken = take_rows(layer, [1], prefix)
    assert entry_statistics(taken) == [before[1 * HEADS + h][: int(prefix[h])] for h in range(HEADS)]
    with pytest.raises(ValueError, match="differ in decode-cap statistics"):
        VarLenLayer.concat([layer, random_layer(1, 12)])


@pytest.mark.parametrize("entries", [5, 9000])
def test_growing_a_layer_keeps_every_segment(entries):
    """``reserve`` lays the segments out in bigger rooms; the copy goes in slices (at most an eighth of
    the entries, at least 4,096 at a time), so 9,000 entries per segment take several."""
    g = torch.Generator().manual_seed(entries)
    rows, total = 2, 2 * HEADS * entries
    length = torch.tensor([entries, entries - 3, entries // 2, 1])
    start = torch.arange(rows * HEADS) * entries
    keys, values = torch.randn(total, DIM, generator=g), torch.randn(total, DIM, generator=g)
    positions = torch.randint(0, 10**6, (total,), generator=g, dtype=torch.int32)
    layer = VarLenLayer(keys, values, positions, start, length, torch.full((4,), entries), rows, HEADS)
    before = segments(layer)
    layer.reserve(40)
    assert segments(layer) == before
    assert bool((layer.capacity >= layer.length + 40).all()) and layer.keys.shape[0] == int(layer.capacity.sum())
