"""ExpectedAttention (Devoto et al., arXiv 2510.00636; kvpress ``ExpectedAttentionPress``): the
attention that *future* queries are expected to pay each entry, from the statistics of the
context's own queries. No extra pass.

Per (row, query head), over the context's real queries except the first ``sink_tokens``: the mean
mu and covariance Sigma (1/N) of the pre-RoPE queries (the post-RoPE queries the attention sees are
un-rotated with the model's rotary embedding). Future queries sit at positions n .. n+F-1
(F = ``future_positions``); with R_p their rotation and R = mean_p R_p, they are modelled as
q ~ N(R mu, R Sigma R^T) (the mean rotation applied to Sigma, as kvpress does). For a post-RoPE key k:

    z = mu'.k / sqrt(D) + k^T Sigma' k / (2 D)      (log E[exp(q.k / sqrt(D))] for a Gaussian q)

softmax over the row's non-sink keys, mean over the query heads of each KV group. With
``use_vnorm`` the score is ``(s + vnorm_epsilon) * ||V_i||_2`` (kvpress's default), except under the
CriticalKV selection, whose ``||V_i W_O||`` already weighs values. Sinks and the observation window
score +inf (always kept), padding -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from ..parts import LayerContext, Scorer
from ..rope import rotate_half, rotation_matrix, unrotate
from .common import SinkOptions, finalise, sink_mask


class ExpectedAttentionOptions(SinkOptions):
    """ExpectedAttention scorer"""

    future_positions: int = Field(512, ge=1, description="future query positions whose rotation is averaged")
    use_covariance: bool = Field(True, description="include the query covariance term")
    use_vnorm: bool = Field(True, description="weigh by ||V||_2 (off under the CriticalKV selection)")
    vnorm_epsilon: float = Field(0.0, ge=0.0, description="added to the score before the ||V|| weight")


@dataclass
class QueryStatistics:
    """mean: (B, H_q, D); cov: (B, H_q, D, D) or None; future cos / sin means: (B, D)."""

    mean: torch.Tensor
    cov: torch.Tensor | None
    future_cos: torch.Tensor
    future_sin: torch.Tensor


def query_statistics(query, key_pos, rotary, sink_tokens: int, future: int, covariance: bool) -> QueryStatistics:
    """query: (B, H_q, n, D) post-RoPE prefill queries; key_pos: (B, n) (-1 = padding)."""
    cos, sin = rotary(key_pos.clamp(min=0))  # (B, n, D)
    pre = unrotate(query.float(), cos[:, None], sin[:, None])
    use = ((key_pos >= 0) & ~sink_mask(key_pos, sink_tokens)).float()[:, None, :, None]  # (B, 1, n, 1)
    count = use.sum(2).clamp(min=1.0)  # (B, 1, 1)
    mean = (pre * use).sum(2) / count
    cov = None
    if covariance:
        centred = (pre - mean[:, :, None]) * use
        cov = centred.transpose(-1, -2) @ centred / count[..., None]
    lengths = (key_pos >= 0).sum(-1)
    positions = lengths[:, None] + torch.arange(future, device=key_pos.device)[None]
    f_cos, f_sin = rotary(positions)
    return QueryStatistics(mean, cov, f_cos.mean(1), f_sin.mean(1))


def expected_attention_scores(stats: QueryStatistics, key, key_pos, sink_tokens: int) -> torch.Tensor:
    """key: (B, H_kv, n, D) post-RoPE -> (B, H_kv, n) expected attention (softmax over non-sink keys)."""
    bsz, h_kv, n, dim = key.shape
    h_q = stats.mean.shape[1]
    c, s = stats.future_cos[:, None], stats.future_sin[:, None]  # (B, 1, D)
    mean = stats.mean * c + rotate_half(stats.mean) * s  # R mu
    keys = key.float().repeat_interleave(h_q // h_kv, dim=1)  # (B, H_q, n, D)
    logits = (keys @ mean[..., None]).squeeze(-1) / dim**0.5
    if stats.cov is not None:
        rot = rotation_matrix(stats.future_cos, stats.future_sin)[:, None]  # (B, 1, D, D)
        cov = rot @ stats.cov @ rot.transpose(-1, -2)
        logits = logits + ((keys @ cov) * keys).sum(-1) / (2 * dim)
    scored = (key_pos >= 0) & ~sink_mask(key_pos, sink_tokens)
    logits = logits.masked_fill(~scored[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no scored key: zeros
    return probs.view(bsz, h_kv, h_q // h_kv, n).mean(2)


class ExpectedAttention(Scorer):
    name = "expected_attention"
    options = ExpectedAttentionOptions
    summary = "expected attention of future queries from the context's query statistics (arXiv 2510.00636)"
    observes_in_slices = False  # statistics over every query of the layer at once

    def observe(self, query, key_pos, options: ExpectedAttentionOptions, window, rotary=None, inputs=None):
        if rotary is None:
            raise ValueError("expected_attention needs the model's rotary embedding (Compressor(rotary=...))")
        return query_statistics(
            query, key_pos, rotary, options.sink_tokens, options.future_positions, options.use_covariance
        )

    def score(self, ctx: LayerContext, options: ExpectedAttentionOptions) -> torch.Tensor:
        scores = expected_attention_scores(ctx.observed, ctx.key, ctx.key_pos, options.sink_tokens)
        if options.use_vnorm and not ctx.selection_weighs_values:  # else the selection weighs by it
            scores = (scores + options.vnorm_epsilon) * ctx.value.float().norm(dim=-1)
        scores = scores.masked_fill(sink_mask(ctx.key_pos, options.sink_tokens)[:, None, :], float("inf"))
        return finalise(scores, ctx.key_pos, ctx.row_window)
