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
    """Per-row (budget, window), both (B,) long. lengths: (B,) real (unpadded) token counts.

    The window (the row's last ``window`` tokens, or all of a shorter row) is always kept: a
    ``cache_size`` whose share of a row falls below it is raised to it (the engine warns; the kept
    count is what the output reports). A ``budget`` below the window is refused by the config."""
    lengths = lengths.to(torch.long)
    if budget is not None:
        b = torch.full_like(lengths, int(budget))
    else:
        b = torch.round(lengths.double() * cache_size).to(torch.long)
    w = torch.minimum(torch.full_like(lengths, int(window)), lengths.clamp(min=1))
    b = torch.minimum(torch.maximum(b, w), lengths.clamp(min=1))
    return b, w
