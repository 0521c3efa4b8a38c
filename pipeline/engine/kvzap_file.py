"""KVzap files: the learned scorer's weights and shares for one model, as safetensors.

Written by ``jobs/calibrate_kvzap.py`` (:mod:`pipeline.eval.kvzap_calibration`), read by the engine
for methods whose parts need them (the ``kvzap`` scorer, the ``shares`` allocation). Tensors: those
of :class:`~pipeline.kv.kvzap_model.KVzapModel` plus ``shares`` (S, L, H_kv) and ``share_sizes`` (S,), or
shares per context length (N, S, L, H_kv) with ``share_lengths`` (N,).
Metadata (strings): ``format``, ``kind``, ``model`` (the name it was calibrated with),
``fingerprint`` (JSON: the model's shape and a per-layer weight probe), ``fit`` (JSON: held-out fit
quality per layer) and ``settings`` (JSON: how it was made).

A file is checked twice: before a job starts (:func:`resolve_kvzap`: it exists and names the job's
model) and when the engine loads it (:func:`load_kvzap`: the loaded model's shape and weights match
the fingerprint). Either failure names both models.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..kv.attention.registered import attention_modules
from ..kv.config import CompressionConfig
from ..kv.kvzap_model import KVzapModel, per_length_model

FORMAT = "criticalkv-kvzap/1"
RESOURCES = Path(__file__).resolve().parent.parent / "resources" / "kvzap"
#: model short name -> shipped KVzap file name
SHIPPED = {"smollm2": "smollm2-135m-instruct.safetensors"}
SHAPE_KEYS = ("model_type", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
PROBE_RTOL = 0.02  # weight probes of one model loaded in another dtype agree far better than this


def model_fingerprint(model: torch.nn.Module) -> dict:
    """The model's shape and, per layer, the mean |W_k| (a probe that tells two same-shaped models apart)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    probe = [float(m.k_proj.weight.detach().float().abs().mean()) for m in attention_modules(model)]
    return {
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_heads": heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "vocab_size": cfg.vocab_size,
        "probe": [round(p, 7) for p in probe],
    }


def fingerprint_mismatch(stored: dict, current: dict) -> str | None:
    """What differs between two fingerprints (None when they match)."""
    for key in SHAPE_KEYS:
        if stored.get(key) != current.get(key):
            return f"{key} {stored.get(key)} vs {current.get(key)}"
    a, b = torch.tensor(stored["probe"]), torch.tensor(current["probe"])
    if a.shape != b.shape or not torch.allclose(a, b, rtol=PROBE_RTOL, atol=0.0):
        return "the weights differ (per-layer probe)"
    return None


def write_kvzap(path: str | Path, kvzap: KVzapModel, model_name: str, fingerprint: dict, fit: dict, settings: dict):
    """Write a KVzap file; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().float().contiguous().cpu() for name, t in kvzap.tensors.items()}
    tensors["shares"] = kvzap.shares.float().contiguous().cpu()
    tensors["share_sizes"] = kvzap.share_sizes.float().contiguous().cpu()
    if kvzap.share_lengths is not None:
        tensors["share_lengths"] = kvzap.share_lengths.float().contiguous().cpu()
    metadata = {
        "format": FORMAT,
        "kind": kvzap.kind,
        "model": model_name,
        "fingerprint": json.dumps(fingerprint),
        "fit": json.dumps(fit),
        "settings": json.dumps(settings),
    }
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # safetensors writes 0600; the file is no secret: the process's umask decides
    return path


def read_metadata(path: str | Path) -> dict:
    """The file's metadata with the JSON fields parsed; ValueError naming the file when it is no KVzap file."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ValueError(f"kvzap_model: {path} is not a safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"kvzap_model: {path} is not a KVzap file (format {meta.get('format')!r}, expected {FORMAT!r})"
        )
    out = dict(meta)
    for key in ("fingerprint", "fit", "settings"):
        out[key] = json.loads(meta.get(key) or "{}")
    return out


def load_kvzap(path: str | Path, model: torch.nn.Module, model_name: str) -> KVzapModel:
    """The KVzap model in ``path`` for ``model`` (on the model's device); refuses a file made for another model."""
    meta = read_metadata(path)
    mismatch = fingerprint_mismatch(meta["fingerprint"], model_fingerprint(model))
    if mismatch is not None:
        raise ValueError(
            f"kvzap_model: {path} was calibrated for model {meta.get('model')!r}, not for the loaded model "
            f"{model_name!r} ({mismatch}); make one with jobs/calibrate_kvzap.py --model {model_name}"
        )
    return read_kvzap(path, meta).to(next(model.parameters()).device)


def read_kvzap(path: str | Path, meta: dict | None = None) -> KVzapModel:
    """The KVzap model in ``path`` on the CPU, without the model check of :func:`load_kvzap` (for tools that
    combine or inspect files); ``meta``: its :func:`read_metadata`, when already read."""
    meta = read_metadata(path) if meta is None else meta
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    shares, sizes, lengths = tensors.pop("shares"), tensors.pop("share_sizes"), tensors.pop("share_lengths", None)
    return KVzapModel(meta["kind"], tensors, shares, sizes, lengths)


def per_length_file(paths: list[Path], lengths: list[int]) -> tuple[KVzapModel, dict, dict]:
    """Single-length files read at their own context lengths (ascending) as one model
    (:func:`~pipeline.kv.kvzap_model.per_length_model`), with each file's mean fit and settings by length,
    for :func:`write_kvzap` (how the shipped SmolLM2 file is made)."""
    metas = [read_metadata(path) for path in paths]
    model = per_length_model([read_kvzap(path, meta) for path, meta in zip(paths, metas)], lengths)
    fit = {"per_length": {str(n): meta["fit"].get("mean") for n, meta in zip(lengths, metas)}}
    settings = {"per_length": {str(n): meta["settings"] for n, meta in zip(lengths, metas)}}
    return model, fit, settings


def shipped_kvzap(model_name: str) -> Path | None:
    """Path of the KVzap file shipped for a model short name, or None."""
    name = SHIPPED.get(model_name.lower())
    path = RESOURCES / name if name else None
    return path if path is not None and path.is_file() else None


def resolve_kvzap(config: CompressionConfig, model_name: str) -> CompressionConfig:
    """``config`` with ``kvzap_model`` filled in where its method needs one and none was named.

    Raises ``ValueError`` starting with ``kvzap_model:`` when the named file is missing, is no KVzap
    file, was made for another model name, or when no calibration ships for the model.
    """
    if not config.needs_kvzap_model or not config.compresses:
        return config
    if config.kvzap_model is None:
        shipped = shipped_kvzap(model_name)
        if shipped is None:
            raise ValueError(
                f"kvzap_model: method {config.method!r} needs a KVzap file and none ships for model "
                f"{model_name!r}; let the batch job calibrate one on its documents (--calibrate auto, the default), "
                f"make one with jobs/calibrate_kvzap.py --model {model_name} and pass --kvzap-model, or choose a "
                "method that needs no calibration (criticalkv-layer-defensivekv holds up at --cache-size 0.4: "
                "0.94-0.99x of the full cache; criticalkv-layer-kvzip at any size, with a slow prefill)"
            )
        return config.model_copy(update={"kvzap_model": shipped})
    if not Path(config.kvzap_model).is_file():
        raise ValueError(f"kvzap_model: file not found: {config.kvzap_model}")
    stored = read_metadata(config.kvzap_model).get("model", "")
    if stored.lower() != model_name.lower():
        raise ValueError(
            f"kvzap_model: {config.kvzap_model} was calibrated for model {stored!r}, but this run uses model "
            f"{model_name!r}; make one with jobs/calibrate_kvzap.py --model {model_name}"
        )
    return config
