"""StreamingLLM (Xiao et al., arXiv 2309.17453): attention sinks (first tokens) + most recent tokens."""

from __future__ import annotations

import torch

from ..parts import LayerContext, Scorer
from .common import SinkOptions, finalise, sink_mask


def streamingllm_scores(key_pos: torch.Tensor, num_heads: int, window: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """Sinks (first ``sink_tokens`` real tokens) first, then recency.

    key_pos: (B, n). Returns (B, H_kv, n) float32: +inf for sinks and window, position+1
    otherwise (so a top-b selection keeps sinks + the b - sinks most recent tokens).
    """
    scores = (key_pos.float() + 1.0)[:, None, :].expand(-1, num_heads, -1).clone()
    scores = scores.masked_fill(sink_mask(key_pos, sink_tokens)[:, None, :], float("inf"))
    return finalise(scores, key_pos, window)


class StreamingLLM(Scorer):
    name = "streamingllm"
    options = SinkOptions
    summary = "attention sinks + most recent tokens (arXiv 2309.17453)"

    def score(self, ctx: LayerContext, options: SinkOptions) -> torch.Tensor:
        return streamingllm_scores(ctx.key_pos, ctx.key.shape[1], ctx.row_window, options.sink_tokens)
