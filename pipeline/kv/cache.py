"""``VarLenCache``: a transformers ``Cache`` whose layers hold per-(row, KV head) variable-length K/V.

Life of a batch (driven by :class:`pipeline.engine.Engine`):

1. ``begin_chunk(positions)`` with the left-padded context's positions (B, n), -1 on padding;
   the model's forward calls ``update`` (which only passes the dense K/V through) and then the
   registered attention function, which calls :meth:`attend`: dense causal attention, then the
   :class:`~pipeline.kv.compress.Compressor` picks the entries to keep and they are copied into
   an exactly-sized :class:`~pipeline.kv.storage.VarLenLayer`. The dense K/V of the layer are
   dropped when the layer returns, so peak memory is the compressed cache + one layer's full K/V.
2. Later chunks (question tokens, then one token per decode step): ``update`` appends to every
   segment, :meth:`attend` runs attention over the variable-length segments with the kernel
   :func:`~pipeline.kv.varlen_kernels.choose_kernel` picks (fp32 reference on CPU, flash-attn's
   varlen kernel or SDPA on CUDA). A decode step over a uniform, padding-free cache (uniform
   budgets) skips all of that: SDPA reads a zero-copy (B, H_kv, L, D) view of the store.
3. Optional decode-time cap (``max_cache_tokens``): after each later chunk, segments longer than
   the cap evict their lowest ``accumulated attention x projected value norm`` entries (H2O-style
   accumulation, CriticalKV's norm), never the most recent ``window`` tokens.

Public read-back: :meth:`kept_positions` gives the original positions held for (layer, row, head).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from .attention import dense_prefill_attention, varlen_attention
from .varlen_kernels import choose_kernel, flash_varlen_attention, sdpa_varlen_attention
from .compress import Compressor
from .storage import VarLenLayer


class VarLenCache(Cache):
    """Variable-length KV cache for ``num_layers`` layers; see module docstring."""

    def __init__(self, num_layers: int, compressor: Compressor | None, capture_window: int = 0) -> None:
        """``compressor=None`` makes a *capture* cache: the prefill keeps each layer's dense K/V and
        its last ``capture_window`` queries (no compression), and :meth:`from_capture` then derives
        one compressed cache per method from that single prefill (compression sweeps)."""
        # The base class' layer list is not used: storage is per layer in ``self.store``.
        self.layers = []
        self.layer_class_to_replicate = None
        self.offloading = False
        self.num_layers = num_layers
        self.compressor = compressor
        self.store: list[VarLenLayer | None] = [None] * num_layers
        self.compress_seconds = 0.0
        self._chunk_pos: torch.Tensor | None = None
        self._chunk_padding = False
        self.kernels_used: set[str] = set()  # attention paths taken after the prefill (diagnostics)
        self._query_pos: torch.Tensor | None = None
        self._appended: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._snapshot: object | None = None
        self.context_entries: torch.Tensor | None = None  # (B,) kept entries per row after prefill
        self.context_bytes: torch.Tensor | None = None  # (B,) bytes held per row after prefill
        self.capture_window = capture_window
        self.captured: list[tuple | None] = [None] * num_layers
        self.cap = compressor.config.max_cache_tokens if compressor is not None else None
        self.window = compressor.config.window if compressor is not None else 0

    # ------------------------------------------------------------------ chunk bookkeeping
    def begin_chunk(self, positions: torch.Tensor) -> None:
        """Declare the positions of the next forward's tokens: (B, T) long, -1 on padding.

        Padding queries are given the position just before the row's first real token of the
        chunk so that they attend to earlier entries only (finite, ignored outputs).
        """
        positions = positions.to(torch.long)
        real = positions >= 0
        big = torch.iinfo(torch.long).max
        first = torch.where(real, positions, torch.full_like(positions, big)).min(-1, keepdim=True).values
        first = torch.where(first == big, torch.zeros_like(first), first)
        self._chunk_pos = positions
        self._chunk_padding = not bool(real.all())
        self._query_pos = torch.where(real, positions, (first - 1).clamp(min=0).expand_as(positions))

    @property
    def is_prefilled(self) -> bool:
        return self.store[0] is not None

    # ------------------------------------------------------------------ transformers Cache API
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, *args, **kwargs):
        """Called by the attention module with post-RoPE K/V (B, H_kv, T, D)."""
        layer = self.store[layer_idx]
        if layer is not None:
            layer.append(key_states, value_states, self._chunk_pos, has_padding=self._chunk_padding)
            self._appended[layer_idx] = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        layer = self.store[layer_idx]
        return 0 if layer is None else int(layer.positions.max().item()) + 1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.num_layers

    # ------------------------------------------------------------------ attention entry point
    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Attention for one layer; compresses on the prefill chunk. Returns (B, H_q, T, D)."""
        idx = module.layer_idx
        if self._chunk_pos is None:
            raise RuntimeError("VarLenCache.begin_chunk(positions) must be called before each forward")
        layer = self.store[idx]
        if layer is None:
            out = dense_prefill_attention(query, key, value, self._chunk_pos, scaling)
            if self.compressor is None:
                q_tail = query[:, :, -self.capture_window :].clone() if self.capture_window else query[:, :, :0]
                self.captured[idx] = (module, q_tail, key, value, self._chunk_pos, scaling)
            else:
                self._compress(idx, module, query, key, value, scaling)
            return out
        track = self.cap is not None
        kernel = choose_kernel(query, need_probs=track)
        dense = layer.dense_view() if query.shape[2] == 1 and kernel != "flash" and not track else None
        if dense is not None:
            # one new token per row over a uniform, padding-free cache: every held entry precedes
            # it, so no mask is needed and SDPA reads the store in place
            kernel = "dense-sdpa"
            out = F.scaled_dot_product_attention(query, dense[0].to(query.dtype), dense[1].to(query.dtype),
                                                 scale=scaling, enable_gqa=True)
        elif kernel == "flash":
            out = flash_varlen_attention(query, layer, scaling)
        else:
            keys, values, key_pos = layer.padded_view()
            if kernel == "sdpa":
                out = sdpa_varlen_attention(query, keys, values, key_pos, self._query_pos, scaling)
            else:
                out, probs = varlen_attention(query, keys, values, key_pos, self._query_pos, scaling, return_probs=track)
                if track:
                    self._apply_cap(idx, layer, probs)
        self.kernels_used.add(kernel)
        self._appended.pop(idx, None)
        return out

    @classmethod
    def from_capture(cls, capture: "VarLenCache", compressor: Compressor) -> "VarLenCache":
        """A compressed cache built from a capture cache's prefill, as if ``compressor`` had run
        during that prefill (prefill attention does not depend on the method)."""
        if compressor.config.scorer == "snapkv" and compressor.config.window > capture.capture_window:
            raise ValueError(
                f"window {compressor.config.window} exceeds the captured {capture.capture_window} queries"
            )
        cache = cls(capture.num_layers, compressor)
        for idx, (module, q_tail, key, value, key_pos, scaling) in enumerate(capture.captured):
            cache._chunk_pos = key_pos
            cache._compress(idx, module, q_tail, key, value, scaling)
        return cache

    def _compress(self, idx, module, query, key, value, scaling) -> None:
        sync = key.is_cuda
        if sync:
            torch.cuda.synchronize(key.device)
        t0 = time.perf_counter()
        selection = self.compressor.compress_layer(idx, module, query, key, value, self._chunk_pos, scaling)
        layer = VarLenLayer.from_dense(key, value, self._chunk_pos, selection.keep)
        if self.cap is not None:
            keep = selection.keep & (self._chunk_pos >= 0)[:, None, :]
            layer.value_norm = selection.norms[keep].contiguous()
            layer.acc_attention = torch.zeros_like(layer.value_norm)
        self.store[idx] = layer
        if sync:
            torch.cuda.synchronize(key.device)
        self.compress_seconds += time.perf_counter() - t0
        if idx == self.num_layers - 1:
            self.context_entries = self.entries_per_row()
            self.context_bytes = self.bytes_per_row()

    # ------------------------------------------------------------------ decode-time cap
    def _apply_cap(self, idx: int, layer: VarLenLayer, probs: torch.Tensor) -> None:
        """Accumulate attention (mean over the group's query heads, summed over new queries) and
        evict the lowest accumulated-attention x norm entries of segments above the cap."""
        bsz, h_kv, groups, t, length = probs.shape
        index, live = layer.padded_index()
        acc = probs.mean(2).sum(2).reshape(-1, length)  # (S, L)
        layer.acc_attention.index_add_(0, index[live], acc[live])
        new = self._appended.get(idx)
        if new is not None:
            norms = self.compressor.new_entry_norms(idx, new[1])  # (B, H_kv, T)
            tail = layer.start[:, None] + layer.length[:, None] - t + torch.arange(t, device=layer.start.device)
            layer.value_norm[tail.reshape(-1)] = norms.reshape(-1)
        if int(layer.length.max()) <= self.cap:
            return
        pos = torch.where(live, layer.positions[index], torch.full_like(index, -1, dtype=torch.int32))
        newest = pos.max(-1, keepdim=True).values
        protected = pos > newest - self.window
        score = (layer.acc_attention[index] * layer.value_norm[index]).masked_fill(protected, float("inf"))
        score = score.masked_fill(pos < 0, float("-inf")).masked_fill(~live, float("-inf"))
        order = torch.argsort(score, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(length, device=order.device).expand_as(order))
        layer.compact(live & (rank < self.cap) & (pos >= 0))

    # ------------------------------------------------------------------ multi-question support
    def snapshot(self) -> None:
        """Remember the compressed context so that :meth:`restore` can drop a question's tokens."""
        if self.cap is not None:  # eviction may reorder entries: keep a full copy
            self._snapshot = [layer.clone() for layer in self.store]
        else:
            self._snapshot = [layer.length.clone() for layer in self.store]

    def restore(self) -> None:
        if self._snapshot is None:
            raise RuntimeError("restore() without snapshot()")
        if self.cap is not None:
            self.store = [layer.clone() for layer in self._snapshot]
        else:
            for layer, length in zip(self.store, self._snapshot):
                layer.truncate(length)

    # ------------------------------------------------------------------ read-back and accounting
    def kept_positions(self, layer_idx: int, row: int, head: int) -> torch.Tensor:
        """Sorted original token positions currently held for (layer, row, KV head)."""
        layer = self.store[layer_idx]
        if layer is None:
            raise RuntimeError("nothing cached yet for this layer")
        return layer.segment_positions(row, head)

    def entries_per_row(self) -> torch.Tensor:
        """(B,) live entries held per row, summed over layers and KV heads (padding excluded)."""
        total = None
        for layer in self.store:
            index, live = layer.padded_index()
            real = live & (layer.positions[index] >= 0)
            per_row = real.sum(-1).view(layer.num_rows, layer.num_heads).sum(-1)
            total = per_row if total is None else total + per_row
        return total

    def bytes_per_row(self) -> torch.Tensor:
        """(B,) bytes held per row: its entries' share of every per-entry tensor plus its segment
        table rows. Summed over rows this equals :meth:`nbytes` when buffers are exactly sized."""
        total = None
        for layer in self.store:
            per_entry = layer.keys.element_size() * layer.keys.shape[-1] + layer.values.element_size() * layer.values.shape[-1]
            per_entry += layer.positions.element_size()
            per_entry += sum(t.element_size() for t in (layer.acc_attention, layer.value_norm) if t is not None)
            per_segment = sum(t.element_size() for t in (layer.start, layer.length, layer.capacity))
            cap = layer.capacity.view(layer.num_rows, layer.num_heads).sum(-1)
            row_bytes = cap * per_entry + layer.num_heads * per_segment
            total = row_bytes if total is None else total + row_bytes
        return total

    def nbytes(self) -> int:
        """Bytes of every tensor held by the cache."""
        return sum(layer.nbytes() for layer in self.store if layer is not None)
