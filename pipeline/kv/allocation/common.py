"""Row budgets (shared by every allocation) and the safeguard knob of AdaKV and HeadKV.

Row budget ``b`` (per KV head): ``round(cache_size * n_b)`` of row b's own real length, or an
absolute ``budget`` in tokens, clamped to the row length. The observation window shrinks to
``min(window, b)`` for rows whose budget is smaller than the window.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, Field


class SafeguardOptions(BaseModel):
    """AdaKV / HeadKV allocation"""

    alpha_safeguard: float = Field(0.2, ge=0.0, le=1.0, description="every head keeps at least this fraction of b")


def row_budgets(
    lengths: torch.Tensor, cache_size: float, budget: int | None, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (budget, window), both (B,) long. lengths: (B,) real (unpadded) token counts."""
    lengths = lengths.to(torch.long)
    if budget is not None:
        b = torch.full_like(lengths, int(budget))
    else:
        b = torch.round(lengths.double() * cache_size).to(torch.long)
    b = torch.minimum(b.clamp(min=1), lengths.clamp(min=1))
    w = torch.minimum(torch.full_like(lengths, int(window)), b)
    return b, w
