"""The functions registered with transformers' ``AttentionInterface``, and the recording of each
layer's attention input.

Registration (a public extension point; other implementations are untouched):

* :func:`register` adds ``"criticalkv_varlen"``. A model opts in with
  ``model.set_attn_implementation(register())`` and :func:`pipeline.kv.storage.cache.run_chunk` passes the
  cache both as the model's cache argument (:func:`cache_keyword`; transformers calls its ``update``)
  and as ``varlen_cache=``, which
  transformers forwards to the attention function. Masks are derived from original token positions
  held by the cache (never from a cache-position argument, which transformers 5.x no longer
  passes): key j is visible to query q iff ``0 <= pos_j <= pos_q``.
* :func:`register_recording` adds ``"criticalkv_recording"``: plain causal attention over one
  full, unpadded forward without a cache, which hands each layer's post-RoPE ``q, k, v`` to the
  ``attention_recorder=`` object of the model call (``recorder.on_layer(module, q, k, v, scaling)``);
  the diagnostics (perturbation, HeadKV calibration) analyse layers with it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "criticalkv_varlen"
RECORDING_NAME = "criticalkv_recording"


def criticalkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls per layer (registered as ``criticalkv_varlen``).

    Returns the attention output as (B, T, H_q, D), like transformers' own implementations.
    """
    cache = kwargs.get("varlen_cache")
    if cache is None:
        raise RuntimeError(
            "criticalkv_varlen attention needs the VarLenCache passed as `varlen_cache=` to the model call"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = cache.attend(module, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _forward_cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which ``model``'s forward takes its cache: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (the rename). Asked of the forward's signature because a name the
    model does not know is swallowed by its ``**kwargs``: it would silently build a cache of its own."""
    return _forward_cache_keyword(type(model))


def register() -> str:
    """Register the attention function with transformers (idempotent) and return its name."""
    AttentionInterface.register(ATTENTION_NAME, criticalkv_attention_forward)
    return ATTENTION_NAME


def recording_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA of one full forward (no padding, no cache) that also hands q/k/v to the recorder."""
    recorder = kwargs.get("attention_recorder")
    if recorder is None:
        raise RuntimeError(f"{RECORDING_NAME} attention needs `attention_recorder=` in the model call")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if query.shape[2] != key.shape[2]:
        raise RuntimeError(f"{RECORDING_NAME} runs on a single full forward without a cache")
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    recorder.on_layer(module, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def register_recording() -> str:
    """Register the recording attention with transformers (idempotent) and return its name."""
    AttentionInterface.register(RECORDING_NAME, recording_attention_forward)
    return RECORDING_NAME


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules (those with a ``layer_idx`` and an ``o_proj``), in layer order."""
    found = [m for m in model.modules() if hasattr(m, "o_proj") and isinstance(getattr(m, "layer_idx", None), int)]
    return sorted(found, key=lambda m: m.layer_idx)


@contextmanager
def recorded_attention_inputs(model: torch.nn.Module, sink: dict[int, torch.Tensor]) -> Iterator[None]:
    """During the block, every attention module's input hidden states (B, T, hidden) (after the
    layer's input norm) are put in ``sink[layer_idx]`` by forward pre-hooks, removed afterwards."""

    def record(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        sink[module.layer_idx] = hidden

    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in attention_modules(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
