"""HeadKV priors: the per-head importance files the ``headkv`` allocation needs.

A priors file is JSON ``{"scores": [[...] * heads] * layers, ...}`` (written by
``jobs/calibrate_heads.py``, see :mod:`pipeline.eval.calibration`); scores given per query head
are averaged over each GQA group. When a config names no file, the calibration shipped for the
model (``pipeline/resources/headkv/``) is used; :func:`resolve_head_priors` is the one place that
decides this, so the CLI, the jobs and the engine agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..kv.config import CompressionConfig

RESOURCES = Path(__file__).resolve().parent.parent / "resources" / "headkv"
#: model short name -> shipped priors file name
SHIPPED = {"smollm2": "smollm2-135m-instruct.json"}


def shipped_priors(model_name: str) -> Path | None:
    """Path of the priors file shipped for a model short name, or None."""
    name = SHIPPED.get(model_name.lower())
    path = RESOURCES / name if name else None
    return path if path is not None and path.is_file() else None


def resolve_head_priors(config: CompressionConfig, model_name: str) -> CompressionConfig:
    """``config`` with ``head_priors`` filled in where its method needs them and none was named.

    Raises ``ValueError`` starting with ``head_priors:`` when the named file does not exist or no
    calibration ships for the model.
    """
    if not config.needs_head_priors or not config.compresses:
        return config
    if config.head_priors is not None:
        if not Path(config.head_priors).is_file():
            raise ValueError(f"head_priors: file not found: {config.head_priors}")
        return config
    shipped = shipped_priors(model_name)
    if shipped is None:
        raise ValueError(
            f"head_priors: method {config.method!r} needs a HeadKV priors JSON file and none ships for model "
            f"{model_name!r}; write one with jobs/calibrate_heads.py and pass --head-priors"
        )
    return config.model_copy(update={"head_priors": shipped})


def load_head_priors(path: str | Path, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """(L, H_kv) float64 priors from a JSON file, averaged over each GQA group when given per query head."""
    data = json.loads(Path(path).read_text())
    scores = torch.tensor(data["scores"] if isinstance(data, dict) else data, dtype=torch.float64)
    if scores.dim() != 2 or scores.shape[0] != num_layers:
        raise ValueError(f"head_priors {path}: expected {num_layers} layers of scores, got shape {tuple(scores.shape)}")
    if scores.shape[1] != num_kv_heads:
        if scores.shape[1] % num_kv_heads:
            raise ValueError(f"head_priors {path}: {scores.shape[1]} heads per layer do not group into {num_kv_heads}")
        scores = scores.view(num_layers, num_kv_heads, -1).mean(-1)
    if bool((scores < 0).any()):
        raise ValueError(f"head_priors {path}: scores must be non-negative")
    return scores
