"""SnapKV (Li et al., arXiv 2404.14469): observation-window attention.

Softmax attention of the last w context queries over all keys, averaged over the window queries,
smoothed by 1-D pooling over key positions (kernel k, avg or max), then averaged over the query
heads of each GQA group. Defaults (window 32, max-pool 7) are the SnapKV/AdaKV authors'; kvpress
uses window 64 and avg-pool 5.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field, field_validator

from ..parts import LayerContext, Scorer
from .common import finalise, window_mask


class SnapKVOptions(BaseModel):
    """SnapKV scorer"""

    kernel: int = Field(7, ge=1, description="1-D pooling kernel over key positions (odd)")
    pooling: Literal["avg", "max"] = Field("max", description="pooling of the window attention")

    @field_validator("kernel")
    @classmethod
    def _odd_kernel(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError(f"kernel must be odd so pooling keeps positions aligned, got {value}")
        return value


def snapkv_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    key_pos: torch.Tensor,
    window: torch.Tensor,
    kernel: int,
    pooling: str,
    scaling: float,
) -> torch.Tensor:
    """SnapKV observation-window scores.

    query: (B, H_q, m, D) post-RoPE queries of the LAST m prefill positions (m >= window.max();
    the full prefill queries work too); key: (B, H_kv, n, D); key_pos: (B, n) (-1 = padding);
    window: (B,) long, each row's window size (<= the scoring window w = window.max()).
    Returns (B, H_kv, n) float32 (+inf window, -inf padding).
    """
    bsz, h_q, _, dim = query.shape
    h_kv, n = key.shape[1], key.shape[2]
    groups = h_q // h_kv
    w = int(window.max()) if window.numel() else 0
    w = min(w, n, query.shape[2])
    if w == 0:
        return finalise(torch.zeros(bsz, h_kv, n, device=key.device), key_pos, window)
    probs = window_attention(query[:, :, -w:], key, key_pos, scaling)  # (B, H_kv, G, w, n)
    # valid window queries of row b: real tokens among its last window[b] positions
    q_valid = (torch.arange(w, device=key.device)[None, :] >= w - window[:, None]) & (key_pos[:, n - w :] >= 0)
    weight = q_valid.float() / q_valid.float().sum(-1, keepdim=True).clamp(min=1.0)  # (B, w)
    # weighted mean over window queries as (1, w) @ (w, n) per (row, head, group): no transposed copy
    scores = torch.matmul(weight[:, None, None, None, :], probs).squeeze(-2)  # (B, H_kv, G, n)
    # pool over non-window keys only: window keys contribute zeros (as zero padding would)
    scores = scores.masked_fill(window_mask(key_pos, window)[:, None, None, :], 0.0)
    if kernel > 1:
        flat = scores.reshape(-1, 1, n)
        if pooling == "avg":
            flat = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
        else:
            flat = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
        scores = flat.view(bsz, h_kv, groups, n)
    return finalise(scores.mean(dim=2), key_pos, window)


def window_attention(q_win: torch.Tensor, key: torch.Tensor, key_pos: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal softmax attention of the last w prefill queries over all n keys, in float32.

    q_win: (B, H_q, w, D) queries of positions n-w .. n-1; key: (B, H_kv, n, D); key_pos: (B, n).
    Returns (B, H_kv, G, w, n); a padding query that sees no key gets a uniform row (finite).
    """
    bsz, h_q, w, dim = q_win.shape
    h_kv, n = key.shape[1], key.shape[2]
    groups = h_q // h_kv
    q = q_win.reshape(bsz, h_kv, groups * w, dim)
    logits = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scaling  # (B, H_kv, G*w, n)
    logits = logits.view(bsz, h_kv, groups, w, n)
    q_index = torch.arange(n - w, n, device=key.device)
    k_index = torch.arange(n, device=key.device)
    hidden = (k_index[None, :] > q_index[:, None])[None, :, :] | (key_pos < 0)[:, None, :]  # (B, w, n)
    logits = logits.masked_fill_(hidden[:, None, None], torch.finfo(logits.dtype).min)
    return torch.softmax(logits, dim=-1)


class SnapKV(Scorer):
    name = "snapkv"
    options = SnapKVOptions
    summary = "SnapKV observation-window attention, pooled (arXiv 2404.14469)"

    def observed_queries(self, window: int, options: SnapKVOptions) -> int:
        return window

    def score(self, ctx: LayerContext, options: SnapKVOptions) -> torch.Tensor:
        return snapkv_scores(
            ctx.observed, ctx.key, ctx.key_pos, ctx.row_window, options.kernel, options.pooling, ctx.scaling
        )
