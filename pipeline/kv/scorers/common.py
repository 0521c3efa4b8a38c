"""Conventions every scorer's output follows (see :mod:`pipeline.kv.parts`): ``+inf`` on each
row's observation window, ``-inf`` on padding."""

from __future__ import annotations

import torch
from pydantic import BaseModel, Field


class SinkOptions(BaseModel):
    """Attention sinks (StreamingLLM, ExpectedAttention)"""

    sink_tokens: int = Field(4, ge=0, description="first tokens always kept (attention sinks)")


def sink_mask(key_pos: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """(B, n) bool: the first ``sink_tokens`` real tokens of each row."""
    return (key_pos >= 0) & (key_pos < sink_tokens)


def window_mask(key_pos: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """(B, n) bool: the last ``window[b]`` positions of each row (rows are left padded)."""
    n = key_pos.shape[-1]
    idx = torch.arange(n, device=key_pos.device)
    return (idx[None, :] >= n - window[:, None]) & (key_pos >= 0)


def finalise(scores: torch.Tensor, key_pos: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """scores (B, H_kv, n) with the window set to +inf and padding to -inf."""
    in_window = window_mask(key_pos, window)[:, None, :]
    scores = scores.masked_fill(in_window, float("inf"))
    return scores.masked_fill((key_pos < 0)[:, None, :], float("-inf"))
