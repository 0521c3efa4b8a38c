"""The random Llama-3.1-8B-shaped model of the GPU check (and the tiny one of its smoke run).

Built on the meta device, materialised with ``to_empty`` and filled with N(0, 0.02) in place on the
device: no weights are downloaded and initialisation takes seconds. Random weights make the numbers
about cost, not quality. Used by ``benchmarks/gpu_check.py`` and ``benchmarks/compile_probe.py``.
"""

from __future__ import annotations

import contextlib

import torch

from pipeline.kv.attention import register

LLAMA_31_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=131072,
)
SMOKE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=1024,
    max_position_embeddings=4096,
)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Llama of the given shape: meta device -> ``to_empty`` -> in-place normal init on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"), default_dtype(dtype):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for param in model.parameters():
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        else:  # RMSNorm weights
            param.fill_(1.0)
    # Non-persistent buffers (RoPE inverse frequencies) are garbage after to_empty: rebuild them
    # from a freshly constructed module of the same class, computed on the CPU in float32.
    for module in model.modules():
        buffers = dict(module.named_buffers(recurse=False))
        if buffers:
            try:
                fresh = type(module)(config=config)
            except TypeError as exc:
                raise RuntimeError(
                    f"cannot rebuild the buffers of {type(module).__name__} after to_empty: {exc}"
                ) from exc
            for name, value in fresh.named_buffers(recurse=False):
                module._buffers[name] = value.to(device)
    model.eval()
    model.set_attn_implementation(register())
    return model
