"""Helpers shared by the benchmark scripts: the bundled model, contexts of a given token length,
and prefill / decode timed through the library's VarLenCache exactly as the engine runs them."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import replace

import torch

from pipeline.data.synthetic import sample_qa_documents
from pipeline.engine.config import GenerationConfig, ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.loading import load_model
from pipeline.eval.sweep import parse_variant
from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.rope import model_rotary
from pipeline.kv.storage.cache import VarLenCache, run_chunk


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def load_smollm2():
    loaded = load_model(ModelConfig(name="smollm2"))
    loaded.model.set_attn_implementation(register())
    return loaded


def context_ids(tokenizer, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """(1, n_tokens) ids of built-in sample long-document text."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        doc = sample_qa_documents(1, target_words=max(500, n_tokens), seed=seed + len(ids))[0]
        ids += tokenizer(doc["context"], add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[:n_tokens]])


@torch.inference_mode()
def prefill(model, config: CompressionConfig, ids: torch.Tensor) -> tuple[float, VarLenCache]:
    """Seconds for the context prefill including compression, and the resulting cache."""
    cache = VarLenCache(model.config.num_hidden_layers, Compressor(config, rotary=model_rotary(model)))
    pos = torch.arange(ids.shape[1])[None]
    t0 = time.perf_counter()
    run_chunk(model, cache, ids, pos, logits_to_keep=1)
    return time.perf_counter() - t0, cache


@torch.inference_mode()
def decode_ms_per_token(model, cache: VarLenCache, start: int, steps: int, token: int = 42) -> float:
    """Median ms per decode step over ``steps`` greedy-shaped steps (fixed input token)."""
    cache.reserve(steps + 1)
    times = []
    ids = torch.tensor([[token]])
    for i in range(steps):
        pos = torch.tensor([[start + i]])
        t0 = time.perf_counter()
        run_chunk(model, cache, ids, pos, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times)


def median(values) -> float:
    return statistics.median(values)


# knobs of a benchmark's ``NAME[knob=value]`` entry that belong to the engine, not to the compression
ENGINE_KNOBS = ("layerwise_prefill",)


def split_engine_knobs(overrides: dict[str, str]) -> tuple[dict[str, int], dict[str, str]]:
    """A variant's overrides split into the engine's (:data:`ENGINE_KNOBS`, as ints) and the compression's."""
    engine = {k: int(v) for k, v in overrides.items() if k in ENGINE_KNOBS}
    return engine, {k: v for k, v in overrides.items() if k not in ENGINE_KNOBS}


def variant_engine(loaded, variant: str, cache_size: float) -> Engine:
    """An engine on ``loaded`` (a :func:`~pipeline.engine.loading.load_model` result) for one
    ``NAME[knob=value,...]`` entry: its engine knobs on the model, the rest on the compression, at
    ``cache_size`` (the full cache for ``none``), generating one token."""
    name, overrides = parse_variant(variant)
    engine_knobs, overrides = split_engine_knobs(overrides)
    size = 1.0 if name == "none" else cache_size
    config = CompressionConfig.model_validate({"method": name, "cache_size": size, **overrides})
    return Engine(replace(loaded, **engine_knobs), config, GenerationConfig(max_new_tokens=1))
