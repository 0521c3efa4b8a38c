"""Rows of a :class:`~pipeline.kv.storage.cache.VarLenCache` leaving and joining a decode batch.

A continuous decode batch (:mod:`pipeline.engine.continuous`) holds many compressed documents in one
cache, one row each. Between two decode steps rows leave (their answer ended) and rows join (a new
document's compressed context, or a document's next question): the cache is rebuilt **layer by
layer**, so that what exists at once is the batch's cache plus one layer's copy, never two caches.

Each kept segment keeps its capacity (the room reserved for its question and answer), so a row's
later appends do not reallocate; the rebuilt layout starts every segment where the previous ends,
which keeps the block alignment of grown layers (:mod:`pipeline.kv.storage.store`).
"""

from __future__ import annotations

import torch

from .store import CAP_STATISTICS, VarLenLayer


def take_rows(layer: VarLenLayer, rows: list[int], length: torch.Tensor | None = None) -> VarLenLayer:
    """A copy of ``rows`` of ``layer``, in that order, each segment with its own capacity.

    length: optional (len(rows) * H,) entries to keep per segment (a prefix of each: e.g. the context
    alone, dropping the question and answer appended since); default every live entry. The
    decode-time cap's per-entry statistics move with their entries.
    """
    heads, device = layer.num_heads, layer.length.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    segments = (index[:, None] * heads + torch.arange(heads, device=device)).reshape(-1)
    keep = layer.length[segments] if length is None else length.to(device=device, dtype=torch.long)
    if bool((keep > layer.length[segments]).any()):
        raise ValueError("cannot keep more entries than a segment holds")
    capacity = layer.capacity[segments]
    start = torch.cumsum(capacity, 0) - capacity
    total, dim = int(capacity.sum()), layer.keys.shape[-1]
    keys, values = layer.keys.new_zeros(total, dim), layer.values.new_zeros(total, dim)
    positions = torch.full((total,), -1, dtype=torch.int32, device=device)
    stats = {name: getattr(layer, name) for name in CAP_STATISTICS if getattr(layer, name) is not None}
    moved = {name: old.new_zeros(total) for name, old in stats.items()}
    if int(keep.sum()):
        seg = torch.repeat_interleave(torch.arange(segments.numel(), device=device), keep)
        offset = torch.arange(int(keep.sum()), device=device) - (torch.cumsum(keep, 0) - keep)[seg]
        src, dst = layer.start[segments][seg] + offset, start[seg] + offset
        keys[dst], values[dst], positions[dst] = layer.keys[src], layer.values[src], layer.positions[src]
        for name, old in stats.items():
            moved[name][dst] = old[src]
    out = VarLenLayer(keys, values, positions, start, keep.clone(), capacity.clone(), len(rows), heads)
    for name, tensor in moved.items():
        setattr(out, name, tensor)
    return out


def regroup(cache, keep: list[int], joining: list) -> None:
    """Make ``cache`` hold its rows ``keep`` (in that order) followed by every row of the caches in
    ``joining``, one layer at a time (each joining cache's layer is released as it is copied)."""
    for idx in range(cache.num_layers):
        parts = [take_rows(cache.store[idx], keep)] if keep and cache.store[idx] is not None else []
        parts += [other.store[idx] for other in joining]
        cache.store[idx] = None  # the old layer goes before the new one is built
        for other in joining:
            other.store[idx] = None
        cache.store[idx] = VarLenLayer.concat(parts) if len(parts) > 1 else parts[0]


def layer_lengths(cache) -> list[torch.Tensor]:
    """Every layer's (B * H,) segment lengths: a mark to roll single rows back to (:func:`take_rows`)."""
    return [layer.length.clone() for layer in cache.store]
