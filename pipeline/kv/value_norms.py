"""Projected value norms ``m_i = mean_h ||V_i W_O^h||`` (CriticalKV, arXiv 2502.03805) and a cheap
upper bound of the L1 form.

W_O^h (D x hidden) is the slice of ``o_proj`` that multiplies query head h's output; the norm of
a KV head's entry is the mean over the G query heads of its group. Everything is computed in
float32, chunked so that at most (chunk x G*hidden) floats exist at once (never an n x hidden
tensor per head for all entries).

The bound used to prune exact L1 computations (see :mod:`pipeline.kv.selection.criticalkv`):

    m_i = mean_h ||V_i W_h||_1 <= sqrt(hidden) * mean_h ||V_i W_h||_2
        <= sqrt(hidden) * sqrt(V_i M V_i^T),   M = mean_h W_h W_h^T   (Jensen)

one D x D quadratic form per entry and KV head (G * hidden / D times cheaper than the exact norm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_CHUNK = 1024  # entries per exact-norm matmul chunk: bounds the (chunk x G*hidden) fp32 temporary (7 MiB on SmolLM2)


@dataclass
class OutputProjection:
    """Per-layer W_O slices grouped by KV head, cached in float32.

    ``per_kv``: (H_kv, D, G * hidden) so that ``V @ per_kv[k]`` gives every query head's
    projection side by side; ``gram``: (H_kv, G, D, D) with ``W_O^h W_O^h^T``.
    """

    per_kv: torch.Tensor
    gram: torch.Tensor
    mean_gram: torch.Tensor
    hidden: int
    groups: int

    @classmethod
    def from_weight(cls, o_weight: torch.Tensor, num_kv_heads: int, head_dim: int) -> OutputProjection:
        """o_weight: ``o_proj.weight`` (hidden, H_q * D)."""
        hidden, in_features = o_weight.shape
        num_q = in_features // head_dim
        groups = num_q // num_kv_heads
        w = o_weight.detach().float().view(hidden, num_kv_heads, groups, head_dim)  # W^T blocks
        per_head = w.permute(1, 2, 3, 0)  # (H_kv, G, D, hidden) = W_O^h
        per_kv = per_head.permute(0, 2, 1, 3).reshape(num_kv_heads, head_dim, groups * hidden).contiguous()
        gram = torch.matmul(per_head, per_head.transpose(-1, -2)).contiguous()  # (H_kv, G, D, D)
        return cls(per_kv=per_kv, gram=gram, mean_gram=gram.mean(1).contiguous(), hidden=hidden, groups=groups)


@dataclass
class NormStats:
    """How many exact L1 norms were computed vs how many candidates existed, and the seconds the
    selection spent on exact norms and on bounds (benchmarks read these; wall time of the calls,
    which on CUDA is launch time unless the caller synchronises)."""

    candidates: int = 0
    exact: int = 0
    exact_s: float = 0.0
    bound_s: float = 0.0


def per_head_l1_norms(values: torch.Tensor, proj: OutputProjection, kv_head: int) -> torch.Tensor:
    """``||V_i W_O^h||_1`` for every query head h of one KV head's group.

    values: (m, D) entries of KV head ``kv_head`` -> (G, m) float32, chunked over entries.
    """
    out = torch.empty(proj.groups, values.shape[0], dtype=torch.float32, device=values.device)
    w = proj.per_kv[kv_head]
    for begin in range(0, values.shape[0], _CHUNK):
        projected = torch.matmul(values[begin : begin + _CHUNK].float(), w).abs_()  # (c, G*hidden)
        out[:, begin : begin + _CHUNK] = projected.view(-1, proj.groups, proj.hidden).sum(-1).T
    return out


def exact_l1_norms(values: torch.Tensor, proj: OutputProjection, kv_head: int) -> torch.Tensor:
    """m_i for entries of one KV head. values: (m, D) -> (m,) float32 (group mean of the L1 norms)."""
    return per_head_l1_norms(values, proj, kv_head).mean(0)


def l2_norms(value: torch.Tensor, proj: OutputProjection) -> torch.Tensor:
    """mean_h ||V_i W_O^h||_2 for all entries, via the per-head Gram matrices (exact).

    value: (B, H_kv, n, D) -> (B, H_kv, n) float32.
    """
    v = value.float()
    vg = torch.einsum("bknd,kgde->bkgne", v, proj.gram)  # (B, H_kv, G, n, D)
    sq = (vg * v[:, :, None]).sum(-1).clamp(min=0)
    return sq.sqrt().mean(2)


def l1_upper_bounds(value: torch.Tensor, proj: OutputProjection) -> torch.Tensor:
    """Upper bound of the L1 projected norm (module docstring). (B, H_kv, n, D) -> (B, H_kv, n).

    Computed ``_CHUNK`` entries at a time: the (B, H_kv, chunk, D) float32 temporaries stay small
    where the whole n would double a layer's values (this runs while a layer's candidates exist)."""
    n = value.shape[2]
    quad = torch.empty(value.shape[:3], dtype=torch.float32, device=value.device)
    for start in range(0, n, _CHUNK):
        v = value[:, :, start : start + _CHUNK].float()
        quad[:, :, start : start + _CHUNK] = (torch.matmul(v, proj.mean_gram[None]) * v).sum(-1)
    return quad.clamp_(min=0).sqrt_() * (math.sqrt(proj.hidden) * (1.0 + 1e-4)) + 1e-6


def norms_for_mask(value: torch.Tensor, proj: OutputProjection, mask: torch.Tensor, out: torch.Tensor) -> int:
    """Fill ``out[mask]`` with exact L1 norms; returns how many were computed.

    value: (B, H_kv, n, D); mask / out: (B, H_kv, n).
    """
    count = 0
    for k in range(value.shape[1]):
        sel = mask[:, k]
        if not bool(sel.any()):
            continue
        vals = value[:, k][sel]  # (m, D)
        out[:, k][sel] = exact_l1_norms(vals, proj, k)
        count += vals.shape[0]
    return count


def entry_norms(value: torch.Tensor, proj: OutputProjection, norm: str) -> torch.Tensor:
    """m_i of every entry in the chosen norm. value: (B, H_kv, T, D) -> (B, H_kv, T) float32."""
    if norm == "l2":
        return l2_norms(value, proj)
    bsz, h_kv, t, dim = value.shape
    out = torch.empty(bsz, h_kv, t, dtype=torch.float32, device=value.device)
    for k in range(h_kv):
        out[:, k] = exact_l1_norms(value[:, k].reshape(-1, dim), proj, k).view(bsz, t)
    return out
