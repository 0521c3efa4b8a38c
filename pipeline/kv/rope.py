"""Rotary position embedding helpers (the HF half-split convention: ``x * cos + rotate_half(x) * sin``),
for scorers that reason about queries at other positions (ExpectedAttention).

A ``Rotary`` (:data:`pipeline.kv.parts.Rotary`) maps positions (B, n) to ``cos, sin`` (B, n, D), as
the model's own rotary embedding computes them (RoPE scaling included); :func:`model_rotary`
takes it from a transformers model.
"""

from __future__ import annotations

import torch

from .parts import Rotary


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): (-x2, x1) for the halves x1, x2 of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The pre-RoPE vectors of post-RoPE ``x`` (inverse of ``x * cos + rotate_half(x) * sin``, also
    when the embedding scales cos and sin)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin).clamp(min=1e-12)


def rotation_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(..., D) cos/sin -> (..., D, D) matrix R with ``R @ x == x * cos + rotate_half(x) * sin``.

    Linear in (cos, sin), so the mean of rotations is the rotation matrix of the mean cos / sin.
    """
    dim = cos.shape[-1]
    half = dim // 2
    perm = torch.zeros(dim, dim, dtype=cos.dtype, device=cos.device)  # rotate_half as a matrix
    perm[:half, half:] = -torch.eye(half, dtype=cos.dtype, device=cos.device)
    perm[half:, :half] = torch.eye(half, dtype=cos.dtype, device=cos.device)
    return torch.diag_embed(cos) + sin[..., :, None] * perm


def model_rotary(model: torch.nn.Module) -> Rotary | None:
    """The rotary embedding of a transformers decoder (``model.base_model.rotary_emb``) as a
    :data:`Rotary`, or None when the model has none there."""
    embedding = getattr(getattr(model, "base_model", model), "rotary_emb", None)
    if embedding is None:
        return None

    def rotary(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
        cos, sin = embedding(probe, positions)
        return cos.float(), sin.float()

    return rotary
