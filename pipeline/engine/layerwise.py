"""The layer-by-layer prefill's driver: every decoder layer runs over the whole context, a slice of
tokens at a time, before the next layer starts (the cache side, and why:
:mod:`pipeline.kv.prefill.layer_by_layer`).

The model's own forward is replaced, for the context prefill only, by the same steps over its public
modules: ``embed_tokens``, ``rotary_emb``, each decoder layer, ``norm`` and ``lm_head`` (on the last
column only, as ``logits_to_keep=1`` does). That is exactly what the forward of the decoder-only
families in :data:`LAYERWISE_MODEL_TYPES` computes; any other model (embedding scales, sliding-window
layers, ...) is prefilled in one ordinary forward. Question chunks and decode steps always use the
model's forward.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from ..kv.attention.registered import cache_keyword, recorded_attention_inputs
from ..kv.prefill.rules import PrefillPlan
from ..kv.storage.cache import VarLenCache

LOG = logging.getLogger(__name__)

# model types whose forward is embed -> rotary -> decoder layers -> norm (checked in their transformers code)
LAYERWISE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
AUTO_LAYERWISE_SLICE = 1024  # tokens per slice where ``layerwise_prefill`` is left to auto (CPU; ModelConfig)


def layerwise_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be prefilled layer by layer (None: it can)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in LAYERWISE_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(LAYERWISE_MODEL_TYPES)}"
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "rotary_emb", "layers", "norm")
    if inner is None or not all(hasattr(inner, name) for name in parts) or not hasattr(model, "lm_head"):
        return "the model lacks model.embed_tokens / rotary_emb / layers / norm or lm_head"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return "the model has sliding-window layers"
    return None


def usable_slice(model: torch.nn.Module, tokens: int) -> int:
    """``tokens`` when ``model`` can be prefilled layer by layer, else 0 (with a warning)."""
    if not tokens:
        return 0
    reason = layerwise_unsupported(model)
    if reason is not None:
        LOG.warning("layerwise_prefill=%d ignored, prefilling in one forward: %s", tokens, reason)
        return 0
    return tokens


@torch.inference_mode()
def layerwise_prefill(
    model: torch.nn.Module, cache: VarLenCache, ids: torch.Tensor, positions: torch.Tensor, plan: PrefillPlan
) -> torch.Tensor:
    """Prefill ``ids`` (B, T), left padded, at ``positions`` (B, T) (-1 on padding) into the empty
    ``cache``, layer by layer, ``plan.tokens`` columns at a time (a cache that cannot be prefilled so
    raises ``ValueError``). Returns the last column's logits (B, V) float32.

    The hidden states are held per slice, (B, s, hidden) each, T columns in all: a slice's layer output
    replaces its input (a later slice of the same layer needs only the layer's K/V of the earlier ones,
    which the cache holds), and the last layer's outputs are dropped as they come, but the last slice's
    (only the last column is read), so the prefill's peak, in the last layer, holds the hidden states of
    the slices still to run there. RoPE's (cos, sin) are computed per slice (the same values; not held
    for the whole context)."""
    inner, tokens = model.model, plan.tokens
    keyword = cache_keyword(inner.layers[0])
    bounds = [(start, min(ids.shape[1], start + tokens)) for start in range(0, ids.shape[1], tokens)]
    hidden: list[torch.Tensor | None] = [inner.embed_tokens(ids[:, start:end]) for start, end in bounds]
    layers = inner.layers[: model.config.num_hidden_layers]
    slices = cache.begin_prefill(plan, positions=positions)
    recording = recorded_attention_inputs(model, cache.hidden_states) if cache.wants_hidden_states else nullcontext()
    try:
        with recording:
            for depth, layer in enumerate(layers):
                for i, (start, end) in enumerate(bounds):
                    slices.begin_slice(start, end)
                    piece_pos = positions[:, start:end].clamp(min=0)
                    out = layer(
                        hidden[i],
                        attention_mask=None,
                        position_ids=piece_pos,
                        position_embeddings=inner.rotary_emb(hidden[i], position_ids=piece_pos),
                        use_cache=True,
                        varlen_cache=cache,
                        **{keyword: cache},
                    )
                    needed = depth < len(layers) - 1 or i == len(bounds) - 1  # the next layer's input, or the logits'
                    hidden[i] = (out[0] if isinstance(out, tuple) else out) if needed else None
                    del out  # a dropped output is not held through the next slice's layer forward
    finally:
        cache.hidden_states.clear()
    return model.lm_head(inner.norm(hidden[-1][:, -1:]))[:, -1].float()
