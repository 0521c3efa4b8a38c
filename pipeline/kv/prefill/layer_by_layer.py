"""Layer-by-layer prefill in token slices: the same cache as one forward, without the whole context's
activations.

A one-pass prefill runs every layer over the whole context at once, so besides the cache it holds one
layer's activations for every token: the query projection, RoPE's temporaries, the attention output and
the embeddings the model keeps for the whole forward (about 140 MiB for SmolLM2 at 8K tokens, as much as
the compressed cache at 0.4). Here the driver (:func:`pipeline.engine.layerwise.layerwise_prefill`)
runs layer 0 over the whole context slice by slice, then layer 1, and so on:

- each slice's queries attend to the layer's dense K/V of every earlier slice and of the slice itself
  (:func:`~pipeline.kv.attention.dense.slice_attention`), which is exactly the causal attention of one pass;
  the layer's K/V are written into one (B, H_kv, T, D) buffer as the slices come;
- the scorer observes each slice's queries / hidden states and the observations are merged
  (the scorer's ``merge_observed``);
- after the layer's last slice the whole buffer goes to the layer step, exactly as one pass hands it on
  (:mod:`.layers`), and the buffer is dropped.

So the kept entries are those of one pass (the values differ by float rounding only: another SDPA
call per slice), and what the prefill holds besides the cache is the hidden states (B, T, hidden), one
layer's dense K/V and one slice's activations. A method that decides after the last layer (``layer``
allocation, KVzip) still holds every layer's dense K/V until then. Scorers whose observation needs every
query at once (``expected_attention``) are not sliced (:func:`.rules.layer_by_layer_refusal`).
"""

from __future__ import annotations

import torch

from ..attention.dense import slice_attention
from .base import LayerStep, PrefillStrategy, PrefillTarget
from .rules import layer_by_layer_refusal


class LayerByLayer(PrefillStrategy):
    """The state of one layer-by-layer prefill over ``target`` of contexts at ``positions`` (B, T)
    (-1 on left padding); the driver calls :meth:`begin_slice` before each slice's layer forward."""

    def __init__(self, target: PrefillTarget, layers: LayerStep, positions: torch.Tensor) -> None:
        reason = layer_by_layer_refusal(target.compressor.config)
        if reason is not None:
            raise ValueError(reason)
        super().__init__(target, layers)
        self.positions = positions.to(torch.long)
        self.start = self.end = 0
        self.key: torch.Tensor | None = None  # (B, H_kv, T, D): the current layer's dense K/V so far
        self.value: torch.Tensor | None = None
        self.observed: object = None  # what the scorer observed of the current layer's slices so far

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def begin_slice(self, start: int, end: int) -> None:
        """The next layer forward covers context columns [start, end) (a layer's slices come in order)."""
        self.start, self.end = start, end
        self.target.begin_chunk(self.positions[:, start:end])

    def update(self, idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        the layer goes to the layer step with its whole dense K/V, as a one-pass prefill hands it on."""
        target, compressor = self.target, self.target.compressor
        out = slice_attention(query, key, value, self.positions[:, : self.end], self.start, scaling)
        seen = compressor.observe(query, target.chunk_pos, idx, target.hidden_states.pop(idx, None))
        self.observed = seen if self.start == 0 else self._merged(self.observed, seen)
        if self.end == self.length:
            observed, self.observed = self.observed, None
            key, value, self.key, self.value = self.key, self.value, None, None
            self.layers.add(idx, module, observed, key, value, self.positions, scaling)
        return out

    def _merged(self, earlier: object, later: object) -> object:
        """What the scorer observes of two consecutive query slices of one layer together."""
        compressor = self.target.compressor
        if compressor.scorer is None:
            return None
        return compressor.scorer.merge_observed(earlier, later, compressor.config.window, compressor.scorer_options)
