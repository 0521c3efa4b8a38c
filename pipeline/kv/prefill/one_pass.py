"""The one-pass prefill: the model's own forward over the whole context, each layer's dense causal
attention, then the layer handed to its layer step (:mod:`.layers`): compressed at once, streamed into a
cross-layer budget, or held until the last layer or KVzip's passes. Peak: the compressed cache (or the
held layers) + one layer's dense K/V and the forward's activations over the whole context."""

from __future__ import annotations

import torch

from ..attention.dense import dense_prefill_attention
from .base import PrefillStrategy


class OnePass(PrefillStrategy):
    """One forward over the context; ``layers`` decides when each layer is compressed."""

    def attend(self, idx: int, module, query, key, value, scaling: float) -> torch.Tensor:
        if self.awaiting_passes is not None:
            raise RuntimeError("the context is not compressed yet: run the reconstruction passes and finish() it")
        target = self.target
        out = dense_prefill_attention(query, key, value, target.chunk_pos, scaling)
        observed = target.compressor.observe(query, target.chunk_pos, idx, target.hidden_states.pop(idx, None))
        self.layers.add(idx, module, observed, key, value, target.chunk_pos, scaling)
        return out
