"""Kept positions of every method on fixed inputs, pinned in ``data/pinned_kept.json``.

The file was written by the code before the method layer became composable parts (commit 8b0b896,
through that code's ``VarLenCache(num_layers, Compressor(config, priors))`` + one model call);
``test_pinned_kept.py`` checks that today's code keeps exactly the same positions for the same
inputs (batch of 3 left-padded rows, tiny GQA and MHA models, cache sizes 0.2 and 0.5, every method
name of that time).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

PINNED = Path(__file__).parent / "data" / "pinned_kept.json"
METHODS = (
    "none",
    "streamingllm",
    "snapkv",
    "adakv-snapkv",
    "headkv-snapkv",
    "criticalkv-snapkv",
    "criticalkv-adakv-snapkv",
    "criticalkv-headkv-snapkv",
)
ARCHS = ("llama", "qwen3", "llama-mha")
CACHE_SIZES = (0.2, 0.5)
LENGTHS = (61, 47, 33)


def priors_scores(num_layers: int, num_kv_heads: int) -> list[list[float]]:
    g = torch.Generator().manual_seed(11)
    return torch.rand(num_layers, num_kv_heads, generator=g).mul(0.9).add(0.05).tolist()


def batch_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n) left-padded ids (pad 258) and positions (-1 on padding). No token repeats within a row:
    equal tokens have equal values, and their exact criticality ties were broken arbitrarily by the
    old code's ``torch.topk`` (today: the earlier position), which would make the pin meaningless there."""
    g = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    ids = torch.full((len(LENGTHS), width), 258, dtype=torch.long)
    pos = torch.full((len(LENGTHS), width), -1, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        ids[b, width - n :] = torch.randperm(256, generator=g)[:n]
        pos[b, width - n :] = torch.arange(n)
    return ids, pos


def kept_positions(cache, num_layers: int, rows: int, heads: int) -> list:
    return [
        [[cache.kept_positions(layer, b, h).tolist() for h in range(heads)] for b in range(rows)]
        for layer in range(num_layers)
    ]


def compute(kept_for) -> dict:
    """``kept_for(model, method, cache_size, priors_path, ids, pos)`` -> nested kept lists."""
    import tempfile

    from tests.tiny import tiny_model

    out = {}
    ids, pos = batch_inputs()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            model = tiny_model(arch, seed=4)
            cfg = model.config
            priors = Path(tmp) / f"{arch}.json"
            priors.write_text(json.dumps({"scores": priors_scores(cfg.num_hidden_layers, cfg.num_key_value_heads)}))
            for method in METHODS:
                for size in CACHE_SIZES:
                    out[f"{arch}|{method}|{size:g}"] = kept_for(model, method, size, priors, ids, pos)
    return out


def kept_for_current_code(model, method, size, priors, ids, pos):
    """Kept positions of ``method`` with today's API (batched, left-padded prefill)."""
    from pipeline.engine.priors import load_head_priors
    from pipeline.kv.attention.registered import register
    from pipeline.kv.compress import Compressor
    from pipeline.kv.config import CompressionConfig
    from pipeline.kv.storage.cache import VarLenCache, run_chunk

    cfg = model.config
    comp = CompressionConfig(method=method, cache_size=size, window=4, kernel=3, head_priors=priors)
    tensor = (
        load_head_priors(priors, cfg.num_hidden_layers, cfg.num_key_value_heads) if comp.needs_head_priors else None
    )
    model.set_attn_implementation(register())
    cache = VarLenCache(cfg.num_hidden_layers, Compressor(comp, tensor))
    with torch.inference_mode():
        run_chunk(model, cache, ids.to(model.device), pos.to(model.device))  # CRITICALKV_TEST_DEVICE
    return kept_positions(cache, cfg.num_hidden_layers, ids.shape[0], cfg.num_key_value_heads)


if __name__ == "__main__" and "--write" in sys.argv:  # only to re-pin on purpose: the file is the reference
    PINNED.write_text(json.dumps(compute(kept_for_current_code), separators=(",", ":")) + "\n")
    print(f"wrote {PINNED}")
