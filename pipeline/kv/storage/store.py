"""Flattened variable-length KV storage for one layer.

Layout (the "varlen" layout of flash-attn / vLLM, with each (row, KV head) pair as its own
sequence): entries of all segments live in one flat buffer

    keys, values : (C, D)   C = total capacity, D = head_dim
    positions    : (C,)     int32 original token position of the entry, -1 = not a real entry

Segment ``s = row * H_kv + head`` occupies ``[start[s], start[s] + length[s])``; ``capacity[s]``
slots are reserved for it (bytes: :func:`segment_bytes`). Memory held is the kept entries plus the
growth room asked for, never a padded (B, H, max_len, D) rectangle nor a mask over the full cache.
Keys are stored after RoPE, so eviction may reorder entries; original positions are kept alongside.

Once a layer has grown (:meth:`VarLenLayer.reserve`, before the question and the answer are
appended), every segment's capacity is a multiple of ``BLOCK`` and starts on a block boundary:
``keys.view(C // BLOCK, BLOCK, D)`` is a zero-copy block view in which every block belongs to one
segment (:meth:`VarLenLayer.block_table`), and :meth:`VarLenLayer.head_bias` masks the flat
buffer per KV head. The blocked and flat kernels (:mod:`pipeline.kv.attention.varlen_kernels`) read ragged
caches through them without gathering their entries.

Uniform layouts (uniform budgets, and every decode step after them) are tracked on the Python
side: ``uniform`` is the common segment length when every segment has the same length and
segments sit at ``s * uniform_capacity``, and ``padding_free`` says no live entry is a padding
token. Then appends are strided slice copies and :meth:`dense_view` is a zero-copy (B, H, L, D)
view read directly, with no per-step index arithmetic or host syncs.
"""

from __future__ import annotations

import itertools

import torch

BLOCK = 32  # slots per block of a grown layer (segment capacities are multiples of it)
# the decode-time cap's per-entry statistics (indexed like the keys), moved and copied with their entries
CAP_STATISTICS = ("acc_attention", "value_norm")
POSITION_BYTES, STATISTIC_BYTES, TABLE_BYTES = 4, 4, 8  # int32 positions, float32 statistics, int64 table


def segment_bytes(slots, head_dim: int, itemsize: int, capped: bool):
    """Bytes a segment of ``slots`` slots (int or tensor) holds: K and V (``head_dim`` x ``itemsize``),
    positions, the decode-time cap's statistics (``capped``), its table row. The one footprint rule: a
    store accounts with it and the continuous batch's admission estimates a document with it."""
    per_entry = 2 * head_dim * itemsize + POSITION_BYTES + (len(CAP_STATISTICS) * STATISTIC_BYTES if capped else 0)
    return slots * per_entry + 3 * TABLE_BYTES


class VarLenLayer:
    """Per-layer store of kept K/V entries for ``num_rows`` x ``num_heads`` segments."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        start: torch.Tensor,
        length: torch.Tensor,
        capacity: torch.Tensor,
        num_rows: int,
        num_heads: int,
    ) -> None:
        self.keys = keys
        self.values = values
        self.positions = positions
        self.start = start
        self.length = length
        self.capacity = capacity
        self.num_rows = num_rows
        self.num_heads = num_heads
        # optional per-entry statistics for the decode-time cap (same indexing as keys)
        self.acc_attention: torch.Tensor | None = None
        self.value_norm: torch.Tensor | None = None
        self.uniform: int | None = None  # common segment length of a rectangular layout
        self.uniform_capacity = 0
        self.padding_free = False
        self._blocks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._head_bias: torch.Tensor | None = None
        self._segment_heads = torch.arange(num_rows * num_heads, device=length.device) % num_heads
        self._refresh_layout()

    def _refresh_layout(self) -> None:
        """Recompute ``uniform`` / ``uniform_capacity`` / ``padding_free`` and the free slots every
        segment has from the tensors (syncs)."""
        self._blocks = self._head_bias = None
        self._spare = int((self.capacity - self.length).min()) if self.length.numel() else 0
        self.uniform, self.uniform_capacity = None, 0
        if self.length.numel() and self.is_rectangular():
            length = int(self.length[0])
            if bool((self.length == length).all()):
                self.uniform, self.uniform_capacity = length, int(self.capacity[0])
        if self.uniform is not None:
            live = self.positions.view(self.num_segments, self.uniform_capacity)[:, : self.uniform]
        else:
            index, ok = self.padded_index()
            live = self.positions[index][ok]
        self.padding_free = not bool((live < 0).any())

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dense(
        cls, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
    ) -> VarLenLayer:
        """Build from dense prefill states.

        key, value: (B, H, n, D); positions: (B, n) int, -1 for padding; keep: (B, H, n) bool.
        Kept entries are copied into fresh, exactly-sized buffers (the dense tensors can be freed).
        """
        bsz, heads, n, dim = key.shape
        keep = keep & (positions >= 0)[:, None, :]
        length = keep.sum(-1).reshape(-1).to(torch.long)  # (S,)
        start = torch.zeros_like(length)
        if length.numel() > 1:
            start[1:] = torch.cumsum(length, 0)[:-1]
        pos = positions[:, None, :].expand(bsz, heads, n).reshape(-1).to(torch.int32)
        if bool(keep.all()):  # full cache: hold the dense tensors themselves (no copy when contiguous)
            keys, values = key.reshape(-1, dim).contiguous(), value.reshape(-1, dim).contiguous()
            return cls(keys, values, pos.contiguous(), start, length, length.clone(), bsz, heads)
        flat = keep.reshape(-1).nonzero().squeeze(1)  # index_select: much faster than a boolean mask on CPU
        keys = torch.index_select(key.reshape(-1, dim), 0, flat)
        values = torch.index_select(value.reshape(-1, dim), 0, flat)
        return cls(keys, values, torch.index_select(pos, 0, flat), start, length, length.clone(), bsz, heads)

    @classmethod
    def concat(cls, layers: list[VarLenLayer]) -> VarLenLayer:
        """The rows of several layers (same KV heads and dtype, all with the decode-time cap's statistics
        or none) side by side in one layer, rows of ``layers[0]`` first: one copy of every buffer."""
        carried = [name for name in CAP_STATISTICS if getattr(layers[0], name) is not None]
        if any([n for n in CAP_STATISTICS if getattr(layer, n) is not None] != carried for layer in layers):
            raise ValueError("layers to concatenate differ in decode-cap statistics")
        heads = {layer.num_heads for layer in layers}
        if len(heads) != 1:
            raise ValueError(f"layers to concatenate have different KV head counts: {sorted(heads)}")

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(layer, name) for layer in layers])

        offsets = itertools.accumulate([layer.keys.shape[0] for layer in layers[:-1]], initial=0)
        start = torch.cat([layer.start + offset for layer, offset in zip(layers, offsets)])
        entries, tables = [cat("keys"), cat("values"), cat("positions")], [cat("length"), cat("capacity")]
        joined = cls(*entries, start, *tables, sum(layer.num_rows for layer in layers), heads.pop())
        for name in carried:
            setattr(joined, name, cat(name))
        return joined

    # ------------------------------------------------------------------ properties
    @property
    def num_segments(self) -> int:
        return self.num_rows * self.num_heads

    @property
    def max_length(self) -> int:
        return int(self.length.max()) if self.length.numel() else 0

    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds (K, V, positions, segment table, statistics)."""
        tensors = [self.keys, self.values, self.positions, self.start, self.length, self.capacity]
        tensors += [t for t in (self.acc_attention, self.value_norm, self._head_bias) if t is not None]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def is_rectangular(self) -> bool:
        """True when every segment has the same capacity and segments are back to back."""
        cap = self.capacity
        if cap.numel() == 0 or not bool((cap == cap[0]).all()):
            return False
        expected = torch.arange(cap.numel(), device=cap.device) * cap[0]
        return bool((self.start == expected).all()) and self.keys.shape[0] == int(cap.sum())

    # ------------------------------------------------------------------ growth / append
    def reserve(self, extra: int, slack: int = 0) -> None:
        """Make room for ``extra`` more entries in every segment (at most one reallocation).

        When a reallocation is needed, ``slack`` further slots per segment are added so that
        token-by-token appends do not reallocate at every step.
        """
        if self.uniform is not None and self.uniform + extra <= self.uniform_capacity:
            return
        if extra <= self._spare and self.block_table() is not None:  # no per-step comparison or sync
            return
        new_cap = torch.maximum(self.capacity, self.length + extra + slack)
        self._relayout((new_cap + BLOCK - 1) // BLOCK * BLOCK)

    def _relayout(self, new_capacity: torch.Tensor) -> None:
        """Copy every segment into a fresh buffer with the given per-segment capacities."""
        new_start = torch.zeros_like(new_capacity)
        if new_capacity.numel() > 1:
            new_start[1:] = torch.cumsum(new_capacity, 0)[:-1]
        total = int(new_capacity.sum())
        src, dst = self.live_index(), self.live_index(new_start)
        step = max(4096, -(-src.numel() // 8))  # gathered temporaries of at most an eighth of a buffer
        # one buffer at a time: each old one goes before the next new one exists (keys before values)
        for name in ("keys", "values", "positions", *CAP_STATISTICS):
            old = getattr(self, name)
            if old is None:
                continue
            new = old.new_full((total, *old.shape[1:]), -1 if name == "positions" else 0)
            for at in range(0, src.numel(), step):
                new[dst[at : at + step]] = old[src[at : at + step]]
            setattr(self, name, new)
        self.start, self.capacity = new_start, new_capacity.clone()
        self._refresh_layout()

    def live_index(self, start: torch.Tensor | None = None) -> torch.Tensor:
        """(N,) flat indices of the live entries, segment by segment (``start``: other segment starts,
        e.g. of a new layout; default this layer's own)."""
        start = self.start if start is None else start
        total = int(self.length.sum())
        if total == 0:
            return torch.zeros(0, dtype=torch.long, device=self.length.device)
        seg = torch.repeat_interleave(torch.arange(self.num_segments, device=self.length.device), self.length)
        first = torch.cumsum(self.length, 0) - self.length
        offset = torch.arange(total, device=self.length.device) - first[seg]
        return start[seg] + offset

    def append(
        self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, has_padding: bool | None = None
    ) -> None:
        """Append T new tokens to every segment of their row (each segment's last T entries).

        key, value: (B, H, T, D); positions: (B, T) int (-1 marks padding, which is stored but
        never attended to); ``has_padding``: whether ``positions`` holds a -1 (computed when None).
        """
        bsz, heads, t, dim = key.shape
        if has_padding is None:
            has_padding = bool((positions < 0).any())
        self.reserve(t, slack=max(16, t))
        pos = positions[:, None, :].expand(bsz, heads, t).to(torch.int32)
        if self.uniform is not None:
            cap, old = self.uniform_capacity, self.uniform
            segments = self.num_segments
            self.keys.view(segments, cap, dim)[:, old : old + t] = key.reshape(segments, t, dim)
            self.values.view(segments, cap, dim)[:, old : old + t] = value.reshape(segments, t, dim)
            self.positions.view(segments, cap)[:, old : old + t] = pos.reshape(segments, t)
            if self.acc_attention is not None:
                self.acc_attention.view(segments, cap)[:, old : old + t] = 0.0
            self.uniform, self._head_bias = old + t, None
        else:
            idx = self.start + self.length  # one token: no (S, T) index arithmetic
            if t > 1:
                idx = (idx[:, None] + torch.arange(t, device=idx.device)).reshape(-1)
            self.keys[idx] = key.reshape(-1, dim).to(self.keys.dtype)
            self.values[idx] = value.reshape(-1, dim).to(self.values.dtype)
            self.positions[idx] = pos.reshape(-1)
            if self.acc_attention is not None:
                self.acc_attention[idx] = 0.0
            if self._head_bias is not None:
                self._update_head_bias(idx, pos.reshape(-1), t, has_padding)
        self.length = self.length + t
        self._spare -= t
        self.padding_free = self.padding_free and not has_padding

    # ------------------------------------------------------------------ reading
    def block_table(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a block-aligned layout (see the module docstring): ``block_segment`` (C // BLOCK,)
        long, the segment owning each block, and ``slot`` (C // BLOCK, BLOCK) long, each slot's
        offset inside its segment; None when the layout is not block aligned. Cached per layout."""
        if self._blocks is None:
            cap = self.capacity
            if cap.numel() == 0 or bool((cap % BLOCK != 0).any()) or self.keys.shape[0] != int(cap.sum()):
                return None
            expected = torch.cumsum(cap, 0) - cap
            if not bool((self.start == expected).all()):
                return None
            blocks = cap // BLOCK
            segment = torch.repeat_interleave(torch.arange(cap.numel(), device=cap.device), blocks)
            first = torch.cumsum(blocks, 0) - blocks
            offset = torch.arange(segment.numel(), device=cap.device) - first[segment]
            slot = offset[:, None] * BLOCK + torch.arange(BLOCK, device=cap.device)
            self._blocks = (segment, slot)
        return self._blocks

    def head_bias(self) -> torch.Tensor | None:
        """(H, C) float32 additive mask over the flat buffer: 0 where slot c holds a live, real entry
        of a segment of KV head h, -inf elsewhere; None when the layout is not block aligned. Built
        once per layout and kept current by :meth:`append` (the flat decode kernel's mask)."""
        if self._head_bias is None:
            table = self.block_table()
            if table is None:
                return None
            segment, slot = table
            live = (slot < self.length[segment][:, None]).reshape(-1) & (self.positions >= 0)
            heads = self._segment_heads[segment][:, None].expand(slot.shape).reshape(-1)
            bias = torch.full((self.num_heads, live.numel()), float("-inf"), device=live.device)
            bias[heads[live], live.nonzero().squeeze(1)] = 0.0
            self._head_bias = bias
        return self._head_bias

    def _update_head_bias(self, idx: torch.Tensor, pos: torch.Tensor, t: int, has_padding: bool) -> None:
        """Appended slots ``idx`` (S * T,), segment by segment: live for their own head, padding never."""
        heads = self._segment_heads if t == 1 else self._segment_heads.repeat_interleave(t)
        self._head_bias[heads, idx] = torch.where(pos >= 0, 0.0, float("-inf")) if has_padding else 0.0

    def padded_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, L) flat indices of each segment's slots and a (S, L) bool of live slots, L = max length."""
        max_len = self.max_length
        ar = torch.arange(max_len, device=self.start.device)
        live = ar[None, :] < self.length[:, None]
        index = (self.start[:, None] + ar[None, :]).clamp(max=max(self.keys.shape[0] - 1, 0))
        return index, live

    def dense_view(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Zero-copy keys, values (B, H, L, D) when the layout is uniform and padding-free, else None."""
        if self.uniform is None or not self.padding_free:
            return None
        shape = (self.num_rows, self.num_heads, self.uniform_capacity, self.keys.shape[-1])
        return self.keys.view(shape)[:, :, : self.uniform], self.values.view(shape)[:, :, : self.uniform]

    def padded_view(self, release: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values (S, L, D) and positions (S, L) (-1 where no live entry).

        Zero-copy when the layout is rectangular (uniform budgets); otherwise one gather, where
        ``release`` (a layer about to be dropped) lets its keys go before the values' copy exists."""
        dim = self.keys.shape[-1]
        if self.uniform is not None:
            cap, length = self.uniform_capacity, self.uniform
            keys = self.keys.view(self.num_segments, cap, dim)[:, :length]
            values = self.values.view(self.num_segments, cap, dim)[:, :length]
            return keys, values, self.positions.view(self.num_segments, cap)[:, :length]
        max_len = self.max_length
        if self.is_rectangular() and int(self.capacity[0]) >= max_len:
            cap = int(self.capacity[0])
            keys = self.keys.view(self.num_segments, cap, dim)[:, :max_len]
            values = self.values.view(self.num_segments, cap, dim)[:, :max_len]
            pos = self.positions.view(self.num_segments, cap)[:, :max_len]
            live = torch.arange(max_len, device=pos.device)[None, :] < self.length[:, None]
            return keys, values, torch.where(live, pos, torch.full_like(pos, -1))
        index, live = self.padded_index()
        flat = index.reshape(-1)  # index_select: several times faster than advanced indexing on CPU
        keys = torch.index_select(self.keys, 0, flat).view(*index.shape, dim)
        if release:
            self.keys = None
        values = torch.index_select(self.values, 0, flat).view(*index.shape, dim)
        pos = torch.index_select(self.positions, 0, flat).view(index.shape)
        return keys, values, torch.where(live, pos, torch.full_like(pos, -1))

    def segment_positions(self, row: int, head: int) -> torch.Tensor:
        """Sorted original positions held by segment (row, head), padding excluded."""
        s = row * self.num_heads + head
        begin = int(self.start[s])
        pos = self.positions[begin : begin + int(self.length[s])]
        return torch.sort(pos[pos >= 0]).values

    # ------------------------------------------------------------------ rollback / eviction
    def truncate(self, length: torch.Tensor) -> None:
        """Forget entries appended after a snapshot of ``length`` (no eviction happened since)."""
        self.length = length.clone()
        self._refresh_layout()

    def compact(self, keep_live: torch.Tensor) -> None:
        """Keep only the live entries selected by ``keep_live`` ((S, L) bool over padded slots).

        Rebuilds exactly-sized buffers (memory is released, not masked).
        """
        index, live = self.padded_index()
        keep_live = keep_live & live
        new_len = keep_live.sum(-1)
        flat = index[keep_live]  # row-major: segment order preserved
        self.keys = self.keys[flat].contiguous()
        self.values = self.values[flat].contiguous()
        self.positions = self.positions[flat].contiguous()
        for name in CAP_STATISTICS:
            old = getattr(self, name)
            if old is not None:
                setattr(self, name, old[flat].contiguous())
        self.length = new_len.to(torch.long)
        self.capacity = self.length.clone()
        self.start = torch.zeros_like(self.length)
        if self.length.numel() > 1:
            self.start[1:] = torch.cumsum(self.length, 0)[:-1]
        self._refresh_layout()

    # ------------------------------------------------------------------ accounting
    def entries_per_row(self) -> torch.Tensor:
        """(B,) live entries held per row, summed over KV heads (padding entries excluded)."""
        index, live = self.padded_index()
        real = live & (self.positions[index] >= 0)
        return real.sum(-1).view(self.num_rows, self.num_heads).sum(-1)

    def bytes_per_row(self) -> torch.Tensor:
        """(B,) bytes held per row: its reserved slots' share of every per-entry tensor plus its
        segment-table rows. Summed over rows this equals :meth:`nbytes` when buffers are exactly sized."""
        return self._row_bytes(self.capacity)

    def used_bytes_per_row(self) -> torch.Tensor:
        """(B,) bytes of the slots each row fills (its segments' lengths) plus its segment-table rows;
        at most :meth:`bytes_per_row`, equal to it until room for appends is reserved."""
        return self._row_bytes(self.length)

    def _row_bytes(self, slots: torch.Tensor) -> torch.Tensor:
        """slots: (S,) slots counted per segment -> (B,) bytes per row (:func:`segment_bytes`)."""
        per_segment = segment_bytes(slots, self.keys.shape[-1], self.keys.element_size(), self.value_norm is not None)
        return per_segment.view(self.num_rows, self.num_heads).sum(-1)

    def clone(self) -> VarLenLayer:
        tensors = (self.keys, self.values, self.positions, self.start, self.length, self.capacity)
        copy = VarLenLayer(*(t.clone() for t in tensors), self.num_rows, self.num_heads)
        for name in CAP_STATISTICS:
            old = getattr(self, name)
            setattr(copy, name, None if old is None else old.clone())
        return copy
