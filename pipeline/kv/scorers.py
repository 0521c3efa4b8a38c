"""Base importance scores of context entries, per (row, KV head, position).

Conventions shared by every scorer (so budgets and selection need no special cases):

* output ``scores``: (B, H_kv, n) float32, higher = more important;
* ``+inf`` on the observation window (the last ``window[b]`` real tokens of row b), which is
  always kept and counts inside the budget;
* ``-inf`` on padding (``key_pos < 0``), which is never keepable.

SnapKV (Li et al., arXiv 2404.14469): softmax attention of the last w context queries over all
keys, averaged over the window queries, smoothed by 1-D pooling over key positions (kernel k,
avg or max), then averaged over the query heads of each GQA group.
StreamingLLM (Xiao et al., arXiv 2309.17453): attention sinks (first tokens) + most recent tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_mask(key_pos: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """(B, n) bool: the last ``window[b]`` positions of each row (rows are left padded)."""
    n = key_pos.shape[-1]
    idx = torch.arange(n, device=key_pos.device)
    return (idx[None, :] >= n - window[:, None]) & (key_pos >= 0)


def _finalise(scores: torch.Tensor, key_pos: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    in_window = window_mask(key_pos, window)[:, None, :]
    scores = scores.masked_fill(in_window, float("inf"))
    return scores.masked_fill((key_pos < 0)[:, None, :], float("-inf"))


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
    Returns (B, H_kv, n) float32 (see module conventions).
    """
    bsz, h_q, _, dim = query.shape
    h_kv, n = key.shape[1], key.shape[2]
    groups = h_q // h_kv
    w = int(window.max()) if window.numel() else 0
    w = min(w, n, query.shape[2])
    if w == 0:
        return _finalise(torch.zeros(bsz, h_kv, n, device=key.device), key_pos, window)
    q_win = query[:, :, -w:, :].reshape(bsz, h_kv, groups * w, dim)
    logits = torch.matmul(q_win.float(), key.float().transpose(-1, -2)) * scaling  # (B, H_kv, G*w, n)
    logits = logits.view(bsz, h_kv, groups, w, n)
    q_index = torch.arange(n - w, n, device=key.device)
    k_index = torch.arange(n, device=key.device)
    hidden = (k_index[None, :] > q_index[:, None])[None, :, :] | (key_pos < 0)[:, None, :]  # (B, w, n)
    # a finite fill: a padding query that sees no key gets a uniform row instead of NaNs (weight 0 below)
    logits = logits.masked_fill_(hidden[:, None, None], torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
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
    return _finalise(scores.mean(dim=2), key_pos, window)


def streamingllm_scores(key_pos: torch.Tensor, num_heads: int, window: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """StreamingLLM: sinks (first ``sink_tokens`` real tokens) first, then recency.

    key_pos: (B, n). Returns (B, H_kv, n) float32: +inf for sinks and window, position+1
    otherwise (so a top-b selection keeps sinks + the b - sinks most recent tokens).
    """
    scores = (key_pos.float() + 1.0)[:, None, :].expand(-1, num_heads, -1).clone()
    sinks = (key_pos >= 0) & (key_pos < sink_tokens)
    scores = scores.masked_fill(sinks[:, None, :], float("inf"))
    return _finalise(scores, key_pos, window)
