"""The learned one-pass scorer's weights (KVzap, Jegou & Jeblick, arXiv 2601.07891) and its
calibrated cross-layer shares, as pure tensors.

KVzap replaces KVzip's reconstruction passes by one small model per layer that maps the layer's
attention input h_i (the hidden state after the input norm, (hidden,)) to a predicted KVzip+
log-score per KV head: ``s_i = log max_{j, g} a_ji^g * ||V_i W_O^g||_2 / ||h_j||_2`` (the max over the
reconstruction queries j and the query heads g of the KV group). Two kinds:

* ``linear``: ``s = h @ weight[l].T + bias[l]`` (ridge regression, closed form);
* ``mlp``: ``s = gelu(h @ w1[l].T + b1[l]) @ w2[l].T + b2[l]`` (hidden width M).

``shares`` (S, L, H_kv) are what a global top-k of the true scores over every layer and head (the
``layer`` allocation) gives each (layer, KV head) on calibration documents, as a multiple of the
mean head budget, at the kept fractions ``share_sizes`` (S,); the ``shares`` allocation uses them
to give cross-layer budgets while compressing each layer right after its attention. The file that
holds all of this is read and written by :mod:`pipeline.engine.kvzap_file`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

KINDS = ("linear", "mlp")


class KVzapModelOptions(BaseModel):
    """KVzap scorer / shares allocation"""

    kvzap_model: Path | None = Field(
        None, description="KVzap weights (safetensors; default: the calibration shipped for the model)"
    )


@dataclass
class KVzapModel:
    """Per-layer predictors and shares. weight: (L, H_kv, hidden), bias: (L, H_kv) (linear), or
    w1: (L, M, hidden), b1: (L, M), w2: (L, H_kv, M), b2: (L, H_kv) (mlp); shares: (S, L, H_kv)
    float32 with mean 1 over (L, H_kv) at each size; share_sizes: (S,) ascending kept fractions."""

    kind: str
    tensors: dict[str, torch.Tensor]
    shares: torch.Tensor
    share_sizes: torch.Tensor

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KVzap kind must be one of {KINDS}, got {self.kind!r}")
        needed = ("weight", "bias") if self.kind == "linear" else ("w1", "b1", "w2", "b2")
        missing = [name for name in needed if name not in self.tensors]
        if missing:
            raise ValueError(f"KVzap {self.kind} model lacks tensors {missing}")
        if self.shares.dim() != 3 or self.share_sizes.dim() != 1 or self.shares.shape[0] != self.share_sizes.numel():
            raise ValueError("KVzap shares must be (S, L, H_kv) with one kept fraction per S")

    @property
    def num_layers(self) -> int:
        return self.shares.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.shares.shape[2]

    def to(self, device: torch.device) -> KVzapModel:
        moved = {name: t.to(device) for name, t in self.tensors.items()}
        return KVzapModel(self.kind, moved, self.shares.to(device), self.share_sizes.to(device))

    def predict(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted log-scores of one layer's entries. hidden: (B, n, hidden) -> (B, H_kv, n) float32."""
        h = hidden.float()
        t = self.tensors
        if self.kind == "linear":
            out = torch.matmul(h, t["weight"][layer_idx].T) + t["bias"][layer_idx]
        else:
            mid = F.gelu(torch.matmul(h, t["w1"][layer_idx].T) + t["b1"][layer_idx])
            out = torch.matmul(mid, t["w2"][layer_idx].T) + t["b2"][layer_idx]
        return out.transpose(1, 2)

    def shares_at(self, fractions: torch.Tensor) -> torch.Tensor:
        """Shares interpolated linearly at each row's kept fraction (clamped to the calibrated
        range). fractions: (B,) -> (B, L, H_kv) float64."""
        sizes = self.share_sizes.double().to(fractions.device)
        shares = self.shares.double().to(fractions.device)
        f = fractions.double().clamp(float(sizes[0]), float(sizes[-1]))
        upper = torch.searchsorted(sizes, f).clamp(1, max(sizes.numel() - 1, 1))
        if sizes.numel() == 1:
            return shares[0].expand(f.numel(), -1, -1).clone()
        lo, hi = sizes[upper - 1], sizes[upper]
        t = ((f - lo) / (hi - lo)).clamp(0.0, 1.0)[:, None, None]
        return shares[upper - 1] * (1 - t) + shares[upper] * t
