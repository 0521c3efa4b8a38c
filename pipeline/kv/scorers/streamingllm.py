"""StreamingLLM (Xiao et al., arXiv 2309.17453): attention sinks (first tokens) + most recent tokens."""

from __future__ import annotations

import torch
from pydantic import BaseModel, Field

from ..parts import LayerContext, Scorer
from .common import finalise


class StreamingLLMOptions(BaseModel):
    """StreamingLLM scorer"""

    sink_tokens: int = Field(4, ge=0, description="first tokens always kept (attention sinks)")


def streamingllm_scores(key_pos: torch.Tensor, num_heads: int, window: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """Sinks (first ``sink_tokens`` real tokens) first, then recency.

    key_pos: (B, n). Returns (B, H_kv, n) float32: +inf for sinks and window, position+1
    otherwise (so a top-b selection keeps sinks + the b - sinks most recent tokens).
    """
    scores = (key_pos.float() + 1.0)[:, None, :].expand(-1, num_heads, -1).clone()
    sinks = (key_pos >= 0) & (key_pos < sink_tokens)
    scores = scores.masked_fill(sinks[:, None, :], float("inf"))
    return finalise(scores, key_pos, window)


class StreamingLLM(Scorer):
    name = "streamingllm"
    options = StreamingLLMOptions
    summary = "attention sinks + most recent tokens (arXiv 2309.17453)"

    def score(self, ctx: LayerContext, config) -> torch.Tensor:
        return streamingllm_scores(ctx.key_pos, ctx.key.shape[1], ctx.row_window, config.sink_tokens)
