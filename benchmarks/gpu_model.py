"""The random Llama-3.1-8B-shaped model of the GPU check (and the tiny one of its smoke run).

Built on the meta device, materialised with ``to_empty`` and filled with N(0, 0.02) in place on the
device: no weights are downloaded and initialisation takes seconds. Random weights make the numbers
about cost, not quality. Used by ``benchmarks/gpu_check.py`` and ``benchmarks/compile_probe.py``,
with the methods' compressors (:func:`compressor`; the learned scorer with a random predictor).
"""

from __future__ import annotations

import contextlib

import torch

from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig

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


def random_kvzap(config, device: torch.device, seed: int = 0):
    """A KVzap predictor (linear, arXiv 2601.07891) with random weights for a model of ``config``'s
    shape, and random per-(layer, KV head) shares (mean 1, as calibrated ones are; they make the
    cache ragged, as a real one's do): what the learned scorer costs, not what it keeps (a real one
    is calibrated per model, ``jobs/calibrate_kvzap.py``)."""
    from pipeline.kv.kvzap_model import KVzapModel

    layers, heads, hidden = config.num_hidden_layers, config.num_key_value_heads, config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(layers, heads, hidden, generator=gen) * hidden**-0.5
    shares = torch.rand(3, layers, heads, generator=gen) + 0.5
    shares = shares / shares.mean(dim=(1, 2), keepdim=True)
    tensors = {"weight": weight, "bias": torch.zeros(layers, heads)}
    return KVzapModel("linear", tensors, shares, torch.tensor([0.1, 0.4, 0.9])).to(device)


def compression(method: str, cache_size: float, prefill_chunk: int | None = None) -> CompressionConfig:
    """``method`` at ``cache_size`` (``none``: the full cache), chunked when ``prefill_chunk`` is given."""
    if method == "none":
        return CompressionConfig(method="none")
    return CompressionConfig(method=method, cache_size=cache_size, prefill_chunk=prefill_chunk)


def compressor(method: str, cache_size: float, model, prefill_chunk: int | None = None) -> Compressor:
    """The method's compressor; the learned scorer gets a random predictor of the model's shape
    (:func:`random_kvzap`: its cost, not its choices)."""
    config = compression(method, cache_size, prefill_chunk)
    kvzap = random_kvzap(model.config, model.device) if config.needs_kvzap_model else None
    return Compressor(config, kvzap=kvzap)
