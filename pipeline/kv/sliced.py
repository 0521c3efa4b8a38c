"""Layer-by-layer prefill in token slices: the same cache as one forward, without the whole context's
activations.

A one-pass prefill runs every layer over the whole context at once, so besides the cache it holds one
layer's activations for every token: the query projection, RoPE's temporaries, the attention output and
the embeddings the model keeps for the whole forward (about 140 MiB for SmolLM2 at 8K tokens, as much as
the compressed cache at 0.4). Here the driver (:func:`pipeline.engine.layerwise.layerwise_prefill`)
runs layer 0 over the whole context slice by slice, then layer 1, and so on:

- each slice's queries attend to the layer's dense K/V of every earlier slice and of the slice itself
  (:func:`~pipeline.kv.attention.slice_attention`), which is exactly the causal attention of one pass;
  the layer's K/V are written into one (B, H_kv, T, D) buffer as the slices come;
- the scorer observes each slice's queries / hidden states and the observations are merged
  (:meth:`~pipeline.kv.compress.Compressor.merge_observed`);
- after the layer's last slice the layer is compressed from the whole buffer, exactly as one pass does
  (:meth:`~pipeline.kv.cache.VarLenCache.compress_into`), and the buffer is dropped.

So the kept entries are those of one pass (the values differ by float rounding only: another SDPA
call per slice), and what the prefill holds besides the cache is the hidden states (B, T, hidden), one
layer's dense K/V and one slice's activations. A method that decides after the last layer (``layer``
allocation, KVzip) still holds every layer's dense K/V until then. Scorers whose observation needs every
query at once (``expected_attention``) are not sliced (:attr:`Compressor.observes_in_slices`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import slice_attention

if TYPE_CHECKING:  # annotations only: the cache imports this module
    from .cache import VarLenCache


class LayerSlices:
    """The state of one layer-by-layer prefill over ``cache`` of contexts at ``positions`` (B, T)
    (-1 on left padding); the driver calls :meth:`begin_slice` before each slice's layer forward."""

    def __init__(self, cache: VarLenCache, positions: torch.Tensor) -> None:
        reason = self.refusal(cache)
        if reason is not None:
            raise ValueError(reason)
        self.cache = cache
        self.positions = positions.to(torch.long)
        self.start = self.end = 0
        self.key: torch.Tensor | None = None  # (B, H_kv, T, D): the current layer's dense K/V so far
        self.value: torch.Tensor | None = None
        self.observed: object = None  # what the scorer observed of the current layer's slices so far

    @staticmethod
    def refusal(cache: VarLenCache) -> str | None:
        """Why ``cache`` cannot be prefilled layer by layer (None: it can)."""
        if cache.cap is not None:
            return "a layer-by-layer prefill cannot use the decode-time cap"
        if not cache.compressor.observes_in_slices:
            return f"{cache.compressor.config.method!r} observes every query at once: prefill it in one pass"
        return None

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def begin_slice(self, start: int, end: int) -> None:
        """The next layer forward covers context columns [start, end) (a layer's slices come in order)."""
        self.start, self.end = start, end
        self.cache.begin_chunk(self.positions[:, start:end])

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slice's K/V (B, H_kv, s, D) written into the layer's buffer; returns the buffer's columns
        [0, end) (views)."""
        if self.start == 0:
            shape = (*key.shape[:2], self.length, key.shape[3])
            self.key, self.value = key.new_empty(shape), value.new_empty(shape)
        self.key[:, :, self.start : self.end] = key
        self.value[:, :, self.start : self.end] = value
        return self.key[:, :, : self.end], self.value[:, :, : self.end]

    def attend(self, idx: int, module, query, key, value, scaling: float) -> torch.Tensor:
        """One slice of layer ``idx``: its attention output (B, H_q, s, D); after the layer's last slice
        the layer is compressed from its whole dense K/V, as a one-pass prefill compresses it."""
        cache, compressor = self.cache, self.cache.compressor
        out = slice_attention(query, key, value, self.positions[:, : self.end], self.start, scaling)
        seen = compressor.observe(query, cache.chunk_pos, idx, cache.hidden_states.pop(idx, None))
        self.observed = seen if self.start == 0 else compressor.merge_observed(self.observed, seen)
        if self.end == self.length:
            observed, self.observed = self.observed, None
            key, value, self.key, self.value = self.key, self.value, None, None
            cache.compress_into(idx, module, observed, key, value, self.positions, scaling)
        return out
