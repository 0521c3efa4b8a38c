"""Key-norm scoring (Devoto et al. 2024, arXiv 2406.11430; kvpress's ``KnormPress``): keys with a
low L2 norm draw high attention, so an entry's importance falls with ``||K_i||_2``.

Needs no queries. The score is an attention-like distribution per (row, KV head): the softmax over
the row's real positions of ``-||K_i||_2 / sqrt(D)``. Within a head it orders entries exactly as
kvpress's ``-||K_i||`` does (so top-k keeps the same set); being non-negative and normalised like
SnapKV's window attention, it can stand for ``A_i`` in CriticalKV's ``(A_i + eps) * m_i`` and be
compared across heads by AdaKV (kvpress compares raw negative norms there).
"""

from __future__ import annotations

import torch

from ..parts import LayerContext, Scorer
from .common import finalise


def knorm_scores(key: torch.Tensor, key_pos: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """key: (B, H_kv, n, D); key_pos: (B, n) (-1 = padding); window: (B,) -> (B, H_kv, n) float32."""
    logits = -key.float().norm(dim=-1) / key.shape[-1] ** 0.5
    logits = logits.masked_fill((key_pos < 0)[:, None, :], float("-inf"))
    return finalise(torch.softmax(logits, dim=-1), key_pos, window)


class KNorm(Scorer):
    name = "knorm"
    summary = "low key norm = important (arXiv 2406.11430, kvpress KnormPress)"

    def score(self, ctx: LayerContext, options: None) -> torch.Tensor:
        return knorm_scores(ctx.key, ctx.key_pos, ctx.row_window)
