"""Tiny randomly initialised models and a byte-level tokenizer built in code (no downloads)."""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pipeline.engine.loading import LoadedModel

# CRITICALKV_TEST_DEVICE=cuda runs the model-level tests on a GPU (benchmarks/gpu_check.sh sets it).
DEVICE = torch.device(os.environ.get("CRITICALKV_TEST_DEVICE", "cpu"))

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


ARCHS = {
    # name: (config class, model class, heads, kv heads) -- GQA for all but llama-mha
    "llama": (LlamaConfig, LlamaForCausalLM, 4, 2),
    "llama-mha": (LlamaConfig, LlamaForCausalLM, 4, 4),
    "mistral": (MistralConfig, MistralForCausalLM, 6, 2),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, 4, 2),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, 4, 1),
}


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 2, head_dim: int = 16) -> torch.nn.Module:
    cfg_cls, model_cls, heads, kv_heads = ARCHS[arch]
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=264,
        hidden_size=heads * head_dim,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = head_dim
    if arch == "mistral":
        kwargs["sliding_window"] = None
    model = model_cls(cfg_cls(**kwargs)).eval()
    # random init with small std gives near-uniform attention; widen it so selection matters
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and ("proj" in name):
                p.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = 257
    model.generation_config.pad_token_id = 258
    return model.to(DEVICE)


def tiny_loaded(arch: str = "llama", seed: int = 0, chat: bool = True, **kw) -> LoadedModel:
    return LoadedModel(tiny_model(arch, seed, **kw), tiny_tokenizer(chat), f"tiny-{arch}", DEVICE, torch.float32, 0.0)


def tiny_kvzap(
    num_layers: int,
    num_kv_heads: int,
    hidden: int,
    seed: int = 0,
    kind: str = "linear",
    lengths=(8, 32),
    positions=True,
):
    """A random KVzap model for a model of this shape: weights (with position weights unless
    ``positions`` is False), and shares at three kept fractions, one table per context length of
    ``lengths`` (as a calibration over several lengths writes them; None: one table for every length)."""
    from pipeline.kv.kvzap_model import KVzapModel

    g = torch.Generator().manual_seed(seed)
    if kind == "linear":
        tensors = {
            "weight": torch.randn(num_layers, num_kv_heads, hidden, generator=g),
            "bias": torch.randn(num_layers, num_kv_heads, generator=g),
        }
    else:
        width = 8
        tensors = {
            "w1": torch.randn(num_layers, width, hidden, generator=g) * hidden**-0.5,
            "b1": torch.randn(num_layers, width, generator=g),
            "w2": torch.randn(num_layers, num_kv_heads, width, generator=g),
            "b2": torch.randn(num_layers, num_kv_heads, generator=g),
        }
    if positions:
        tensors["position_weight"] = torch.randn(num_layers, num_kv_heads, 3, generator=g)
    tables = 1 if lengths is None else len(lengths)
    shares = torch.rand(tables, 3, num_layers, num_kv_heads, generator=g) * 2 + 0.05
    shares = shares / shares.mean(dim=(2, 3), keepdim=True)
    sizes = torch.tensor([0.1, 0.4, 0.9])
    if lengths is None:
        return KVzapModel(kind, tensors, shares[0], sizes)
    return KVzapModel(kind, tensors, shares, sizes, torch.tensor(lengths, dtype=torch.float32))


def tiny_kvzap_for(model: torch.nn.Module, seed: int = 0, kind: str = "linear", lengths=(8, 32), positions=True):
    cfg = model.config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size)
    return tiny_kvzap(*shape, seed, kind, lengths, positions).to(DEVICE)


def tiny_kvzap_file(loaded: LoadedModel, directory, seed: int = 0, kind: str = "linear"):
    """A KVzap file for ``loaded`` (its fingerprint and name), random weights; returns the path."""
    from pathlib import Path

    from pipeline.engine.kvzap_file import model_fingerprint, write_kvzap

    path = Path(directory) / f"{loaded.name}-{kind}-{seed}.safetensors"
    if not path.is_file():
        kvzap = tiny_kvzap_for(loaded.model, seed, kind)
        write_kvzap(path, kvzap, loaded.name, model_fingerprint(loaded.model), {"layers": []}, {"seed": seed})
    return path
