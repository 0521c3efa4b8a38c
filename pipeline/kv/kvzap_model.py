"""The learned one-pass scorer's weights (KVzap, Jegou & Jeblick, arXiv 2601.07891) and its
calibrated cross-layer shares, as pure tensors.

KVzap replaces KVzip's reconstruction passes by one small model per layer that maps the layer's
attention input h_i (the hidden state after the input norm, (hidden,)) to a predicted KVzip+
log-score per KV head: ``s_i = log max_{j, g} a_ji^g * ||V_i W_O^g||_2 / ||h_j||_2`` (the max over the
reconstruction queries j and the query heads g of the KV group). Two kinds:

* ``linear``: ``s = h @ weight[l].T + bias[l]`` (ridge regression, closed form);
* ``mlp``: ``s = gelu(h @ w1[l].T + b1[l]) @ w2[l].T + b2[l]`` (hidden width M).

Either kind may add a term in the entry's place in the context, ``position_weight[l] @ f(p, n)``
with ``f = (log(1 + p), log(1 + n - 1 - p), log n)`` (p the entry's position, n the row's context
length; :func:`position_features`). KVzip's scores fall with the distance from the context's end
(its reconstruction queries come after the context), which h_i cannot know under causal attention:
on held-out calibration documents of SmolLM2 the term lifts the linear predictor's R^2 from 0.44 to
0.70, but answers RULER worse at cache 0.4 (docs/results/kvzap-positions/README.md), so the shipped
file predicts from h alone, as KVzap does (calibration option ``positions``).

``shares`` (S, L, H_kv) are what a global top-k of the true scores over every layer and head (the
``layer`` allocation) gives each (layer, KV head) on calibration documents, as a multiple of the
mean head budget, at the kept fractions ``share_sizes`` (S,); the ``shares`` allocation uses them
to give cross-layer budgets while compressing each layer right after its attention. What the global
top-k gives a head depends on the context's length as well as on the kept fraction (at 0.2 the
shares of 4K-token documents differ from those of 512-token ones by a quarter of the budget), so a
calibration over several lengths may keep one table per length (``--shares-by-length``): shares
(N, S, L, H_kv) with ``share_lengths`` (N,), interpolated in log length. A linear file may hold one
predictor per length as well (weight (N, L, H_kv, hidden), bias (N, L, H_kv), :attr:`KVzapModel.per_length`,
made by :func:`per_length_model` from files fitted at one length each), read at each row's length the same
way. The file that holds all of this is read and written by :mod:`pipeline.engine.kvzap_file`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

KINDS = ("linear", "mlp")
POSITION_FEATURES = 3  # log(1 + p), log(1 + distance to the context's end), log(context length)


def position_features(key_pos: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """key_pos: (B, n) positions (-1 on padding, read as 0); lengths: (B,) each row's whole context
    length -> (B, n, 3) float32 ``(log(1 + p), log(1 + max(n - 1 - p, 0)), log n)``."""
    p = key_pos.clamp(min=0).double()
    n = lengths.to(p.device).double().clamp(min=1)[:, None]
    distance = (n - 1 - p).clamp(min=0)
    return torch.stack([p.log1p(), distance.log1p(), n.log().expand_as(p)], dim=-1).float()


class KVzapModelOptions(BaseModel):
    """KVzap scorer / shares allocation"""

    kvzap_model: Path | None = Field(
        None, description="KVzap weights (safetensors; default: the calibration shipped for the model)"
    )


@dataclass
class KVzapModel:
    """Per-layer predictors and shares. weight: (L, H_kv, hidden), bias: (L, H_kv) (linear; with one
    predictor per entry of ``share_lengths``: (N, L, H_kv, hidden) and (N, L, H_kv)), or
    w1: (L, M, hidden), b1: (L, M), w2: (L, H_kv, M), b2: (L, H_kv) (mlp), and optionally
    position_weight: (L, H_kv, 3) (:func:`position_features`); shares: (S, L, H_kv)
    float32 with mean 1 over (L, H_kv) at each size, or (N, S, L, H_kv) with one table per context
    length of ``share_lengths`` (N,) ascending tokens; share_sizes: (S,) ascending kept fractions."""

    kind: str
    tensors: dict[str, torch.Tensor]
    shares: torch.Tensor
    share_sizes: torch.Tensor
    share_lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KVzap kind must be one of {KINDS}, got {self.kind!r}")
        needed = ("weight", "bias") if self.kind == "linear" else ("w1", "b1", "w2", "b2")
        missing = [name for name in needed if name not in self.tensors]
        if missing:
            raise ValueError(f"KVzap {self.kind} model lacks tensors {missing}")
        position = self.tensors.get("position_weight")
        if position is not None and (position.dim() != 3 or position.shape[-1] != POSITION_FEATURES):
            raise ValueError(f"KVzap position_weight must be (L, H_kv, {POSITION_FEATURES})")
        self._check_per_length()
        tables = 3 if self.share_lengths is None else 4
        if (
            self.shares.dim() != tables
            or self.share_sizes.dim() != 1
            or self.shares.shape[-3] != self.share_sizes.numel()
        ):
            raise ValueError(
                "KVzap shares must be (S, L, H_kv), or (N, S, L, H_kv) with N lengths, one kept fraction per S"
            )
        if self.share_lengths is not None:
            lengths = self.share_lengths
            if (
                lengths.dim() != 1
                or lengths.numel() != self.shares.shape[0]
                or not bool((lengths[1:] > lengths[:-1]).all())
            ):
                raise ValueError("KVzap share_lengths must be (N,) ascending, one per shares table")

    def _check_per_length(self) -> None:
        """A linear file may hold one predictor per calibration length: weight (N, L, H_kv, hidden) and
        bias (N, L, H_kv), one per entry of ``share_lengths`` (its shares are per length too)."""
        if not self.per_length:
            return
        weight, bias = self.tensors["weight"], self.tensors["bias"]
        if self.share_lengths is None or weight.shape[0] != self.share_lengths.numel() or bias.dim() != 3:
            raise ValueError("KVzap per-length predictors need bias (N, L, H_kv) and one share_lengths entry per N")
        if self.uses_positions:
            raise ValueError("KVzap per-length predictors take no position_weight")

    @property
    def per_length(self) -> bool:
        """One linear predictor per calibration length (``share_lengths``), interpolated in log length."""
        return self.kind == "linear" and self.tensors["weight"].dim() == 4

    @property
    def num_layers(self) -> int:
        return self.shares.shape[-2]

    @property
    def num_kv_heads(self) -> int:
        return self.shares.shape[-1]

    def to(self, device: torch.device) -> KVzapModel:
        moved = {name: t.to(device) for name, t in self.tensors.items()}
        lengths = None if self.share_lengths is None else self.share_lengths.to(device)
        return KVzapModel(self.kind, moved, self.shares.to(device), self.share_sizes.to(device), lengths)

    @property
    def uses_positions(self) -> bool:
        """The predictions add a term in each entry's position (``position_weight``)."""
        return "position_weight" in self.tensors

    def predict(
        self, layer_idx: int, hidden: torch.Tensor, key_pos: torch.Tensor | None = None, lengths=None
    ) -> torch.Tensor:
        """Predicted log-scores of one layer's entries: :meth:`predict_from_hidden` plus, for a file
        with position weights, :meth:`position_term` (which needs ``key_pos`` (B, n) and ``lengths`` (B,))."""
        out = self.predict_from_hidden(layer_idx, hidden)
        if self.per_length:
            if lengths is None:
                raise ValueError("this KVzap file predicts per context length: pass the context lengths")
            return self.at_lengths(out, lengths)
        if not self.uses_positions:
            return out
        if key_pos is None or lengths is None:
            raise ValueError("this KVzap file predicts from positions too: pass key_pos and the context lengths")
        return out + self.position_term(layer_idx, key_pos, lengths)

    def position_term(self, layer_idx: int, key_pos: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, n) float32: ``position_weight[l] @ f(p, n)`` (a file with :attr:`uses_positions`)."""
        weight = self.tensors["position_weight"]
        features = position_features(key_pos, lengths).to(weight.device)
        return torch.matmul(features, weight[layer_idx].float().T).transpose(1, 2)

    def predict_from_hidden(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """The predictor's term in the attention input. hidden: (B, n, hidden) -> (B, H_kv, n) float32,
        or (B, N, H_kv, n) from each of a :attr:`per_length` file's N predictors (:meth:`at_lengths`
        then reads them at each row's length)."""
        h = hidden.float()
        t = self.tensors
        if self.per_length:
            out = torch.einsum("bnd,khd->bkhn", h, t["weight"][:, layer_idx].float())
            return out + t["bias"][:, layer_idx].float()[None, :, :, None]
        if self.kind == "linear":
            out = torch.matmul(h, t["weight"][layer_idx].T) + t["bias"][layer_idx]
        else:
            mid = F.gelu(torch.matmul(h, t["w1"][layer_idx].T) + t["b1"][layer_idx])
            out = torch.matmul(mid, t["w2"][layer_idx].T) + t["b2"][layer_idx]
        return out.transpose(1, 2)

    def at_lengths(self, predicted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """A :attr:`per_length` file's predictions (B, N, H_kv, n) at each row's context length (B,):
        linear in log length between the two calibration lengths around it, the nearest one outside
        them -> (B, H_kv, n) float32."""
        at = self.share_lengths.double().log()
        x = lengths.to(predicted.device).double().clamp(min=1).log()
        return _interpolate(predicted.transpose(0, 1).double(), at, x).float()

    def shares_at(self, fractions: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Shares at each row's kept fraction and context length: linear in the fraction between
        calibrated sizes, then linear in log length between calibrated lengths (both clamped to the
        calibrated range). fractions, lengths: (B,) -> (B, L, H_kv) float64. ``lengths`` is needed
        only when the file holds one table per length."""
        shares = self.shares.double().to(fractions.device)
        if self.share_lengths is None:
            return _at_fraction(shares, self.share_sizes, fractions)
        if lengths is None:
            raise ValueError("these KVzap shares are calibrated per context length: pass the rows' lengths")
        per_length = torch.stack([_at_fraction(table, self.share_sizes, fractions) for table in shares])  # (N, B, L, H)
        return _interpolate(per_length, self.share_lengths.double().log(), lengths.double().clamp(min=1).log())


def _at_fraction(shares: torch.Tensor, share_sizes: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """shares: (S, L, H) float64 -> (B, L, H), linear in the kept fraction between ``share_sizes``."""
    return _interpolate(shares[:, None], share_sizes.double(), fractions.double())


def _interpolate(tables: torch.Tensor, at: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """tables: (K, B or 1, L, H) given at ascending points ``at`` (K,); x: (B,) -> (B, L, H), linear
    between the two points around each x, clamped to the first / last table outside them."""
    at, x = at.to(tables.device), x.to(tables.device)
    rows = torch.arange(x.numel(), device=tables.device) % tables.shape[1]
    if at.numel() == 1:
        return tables[0, rows].clone()
    x = x.clamp(float(at[0]), float(at[-1]))
    upper = torch.searchsorted(at, x).clamp(1, at.numel() - 1)
    lo, hi = at[upper - 1], at[upper]
    t = ((x - lo) / (hi - lo)).clamp(0.0, 1.0)[:, None, None]
    return tables[upper - 1, rows] * (1 - t) + tables[upper, rows] * t


def per_length_model(models: list[KVzapModel], lengths: list[int]) -> KVzapModel:
    """One file from linear single-length files, each read at its own context length (ascending
    ``lengths``, one per model): their predictors and tables stacked along a length axis (N, ...),
    so that :meth:`KVzapModel.predict` and :meth:`KVzapModel.shares_at` interpolate between them
    in log length. Each model must hold one pooled linear predictor without a position term and one
    shares table, at the same kept fractions."""
    for m in models:
        if m.kind != "linear" or m.uses_positions or m.share_lengths is not None:  # per-length files have lengths
            raise ValueError("per_length_model combines files of one pooled linear predictor and one shares table")
        if not torch.equal(m.share_sizes, models[0].share_sizes):
            raise ValueError("per_length_model: the files' shares are calibrated at different kept fractions")
    tensors = {name: torch.stack([m.tensors[name] for m in models]) for name in ("weight", "bias")}
    shares = torch.stack([m.shares for m in models])
    return KVzapModel("linear", tensors, shares, models[0].share_sizes, torch.tensor(lengths, dtype=torch.float32))
