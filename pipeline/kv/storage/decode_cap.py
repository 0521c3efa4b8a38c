"""Decode-time cap: at most ``max_cache_tokens`` entries per (row, KV head) while generating.

After each chunk that follows the prefill (question, decode steps), segments longer than the cap
evict their lowest ``accumulated attention x projected value norm`` entries (H2O-style
accumulation of the attention each entry receives, CriticalKV's norm m_i), never the most recent
``window`` tokens. Eviction compacts the store (memory is released, not masked).
"""

from __future__ import annotations

import torch

from ..compress import Compressor, LayerSelection
from ..ranking import rank_desc
from .store import VarLenLayer


class DecodeCap:
    """Per-entry statistics and eviction for one cache (see the module docstring)."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.cap = int(compressor.config.max_cache_tokens)
        self.window = compressor.config.window

    def init_layer(self, layer: VarLenLayer, selection: LayerSelection, key_pos: torch.Tensor) -> None:
        """Attach the kept entries' norms (same order as the store) and zero accumulators."""
        keep = selection.keep & (key_pos >= 0)[:, None, :]
        layer.value_norm = selection.norms[keep].contiguous()
        layer.acc_attention = torch.zeros_like(layer.value_norm)

    def after_chunk(
        self,
        layer_idx: int,
        layer: VarLenLayer,
        probs: torch.Tensor,
        new_values: torch.Tensor | None,
        real_queries: torch.Tensor,
    ) -> None:
        """Accumulate the chunk's attention, give the new entries their norms, evict above the cap.

        probs: (B, H_kv, G, T, L) attention of the chunk's T queries over the padded view of
        ``layer`` (see :func:`pipeline.kv.attention.dense.varlen_attention`); new_values: (B, H_kv, T, D)
        values appended by this chunk (None when nothing was appended); real_queries: (B, T) bool,
        False on a left-padded chunk's padding, whose attention (it attends to keep its softmax finite)
        is not the row's and is not accumulated.
        """
        bsz, h_kv, groups, t, length = probs.shape
        index, live = layer.padded_index()
        probs = probs * real_queries.to(probs.dtype)[:, None, None, :, None]
        acc = probs.mean(2).sum(2).reshape(-1, length)  # (S, L): mean over the group, summed over queries
        layer.acc_attention.index_add_(0, index[live], acc[live])
        if new_values is not None:
            norms = self.compressor.new_entry_norms(layer_idx, new_values)  # (B, H_kv, T)
            steps = torch.arange(t, device=layer.start.device)
            tail = layer.start[:, None] + layer.length[:, None] - t + steps
            layer.value_norm[tail.reshape(-1)] = norms.reshape(-1)
        if int(layer.length.max()) <= self.cap:
            return
        pos = torch.where(live, layer.positions[index], torch.full_like(index, -1, dtype=torch.int32))
        newest = pos.max(-1, keepdim=True).values
        protected = pos > newest - self.window
        score = (layer.acc_attention[index] * layer.value_norm[index]).masked_fill(protected, float("inf"))
        score = score.masked_fill(pos < 0, float("-inf")).masked_fill(~live, float("-inf"))
        layer.compact(live & (rank_desc(score) < self.cap) & (pos >= 0))
