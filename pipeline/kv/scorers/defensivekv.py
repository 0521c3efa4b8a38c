"""DefensiveKV (Feng et al., arXiv 2510.13334; code FFY0/DefensiveKV): defensive aggregation of
observation-window attention.

The last w context queries attend to every key (causal softmax in fp32, the window's own keys in
the denominator); the window's columns are then dropped. Each (query head, window query) row is
avg-pooled over key positions (kernel k) and re-scaled to its mass before pooling. Instead of
SnapKV's mean, the score of an entry is the **max** over the window queries and the query heads of
its KV group (the worst case over the observed queries), **clamped from below at its mean** over the
row's non-window keys per KV head (a prior that keeps entries no window query happened to look at
from scoring zero). The authors' code adds its own value-norm stage on top; here CriticalKV's
selection (``criticalkv-defensivekv``) plays that role.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field, field_validator

from ..parts import LayerContext, Scorer
from .common import finalise, window_mask
from .snapkv import window_attention


class DefensiveKVOptions(BaseModel):
    """DefensiveKV scorer"""

    defensive_kernel: int = Field(5, ge=1, description="avg-pooling kernel over key positions (odd; 1 = none)")

    @field_validator("defensive_kernel")
    @classmethod
    def _odd(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError(f"defensive_kernel must be odd so pooling keeps positions aligned, got {value}")
        return value


def defensive_scores(query, key, key_pos, window, kernel: int, scaling: float) -> torch.Tensor:
    """query: (B, H_q, m, D) the last m >= window.max() prefill queries; key: (B, H_kv, n, D);
    key_pos: (B, n); window: (B,) long. Returns (B, H_kv, n) float32 (+inf window, -inf padding)."""
    bsz, h_kv, n, _ = key.shape
    w = min(int(window.max()) if window.numel() else 0, n, query.shape[2])
    if w == 0:
        return finalise(torch.zeros(bsz, h_kv, n, device=key.device), key_pos, window)
    probs = window_attention(query[:, :, -w:], key, key_pos, scaling)  # (B, H_kv, G, w, n)
    keyable = (key_pos >= 0) & ~window_mask(key_pos, window)  # (B, n) real, non-window keys
    probs = probs * keyable[:, None, None, None, :]
    if kernel > 1:
        mass = probs.sum(-1, keepdim=True)
        pooled = F.avg_pool1d(probs.reshape(-1, 1, n), kernel, stride=1, padding=kernel // 2).view(probs.shape)
        pooled = pooled * keyable[:, None, None, None, :]
        probs = pooled * (mass / pooled.sum(-1, keepdim=True).clamp(min=1e-30))
    q_valid = (torch.arange(w, device=key.device)[None, :] >= w - window[:, None]) & (key_pos[:, n - w :] >= 0)
    probs = probs.masked_fill(~q_valid[:, None, None, :, None], float("-inf"))
    worst = probs.amax(dim=(2, 3))  # (B, H_kv, n): max over group heads and window queries
    counts = keyable.sum(-1).clamp(min=1)[:, None]  # (B, 1)
    mean = (worst * keyable[:, None, :]).sum(-1) / counts  # (B, H_kv)
    return finalise(torch.maximum(worst, mean[..., None]), key_pos, window)


class DefensiveKV(Scorer):
    name = "defensivekv"
    options = DefensiveKVOptions
    summary = "window attention, max over window queries and group heads, clamped at its mean (arXiv 2510.13334)"

    def observed_queries(self, window: int, options: DefensiveKVOptions) -> int:
        return window

    def score(self, ctx: LayerContext, options: DefensiveKVOptions) -> torch.Tensor:
        return defensive_scores(
            ctx.observed, ctx.key, ctx.key_pos, ctx.row_window, options.defensive_kernel, ctx.scaling
        )
