"""Choosing again among entries a layer already holds (a chunked prefill's held + new entries, a
streamed budget's shrink): the candidates come per segment (S = B * H_kv rows of padded slots), with
the scores they were kept with and the projected value norms already known.
"""

from __future__ import annotations

import torch

from ..compress import Compressor
from ..parts import LayerContext


def kept_in_order(values: torch.Tensor, keep: torch.Tensor, fill: str = "-inf") -> torch.Tensor:
    """(S, L) values of the kept slots moved to the front of each segment, in slot order, ``fill`` after."""
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    width = max(int(keep.sum(-1).max()) if keep.numel() else 0, 1)
    moved = torch.gather(values, 1, order[:, :width])
    return moved.masked_fill(~torch.gather(keep, 1, order[:, :width]), float(fill))


def fit_width(values: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """(S, W) -> (S, width): cut, or padded with ``fill``."""
    if values.shape[1] >= width:
        return values[:, :width]
    return torch.nn.functional.pad(values, (0, width - values.shape[1]), value=fill)


def select_from_held(
    compressor: Compressor, idx, module, scores, budget, keys, values, seen, row_window, known_norms=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which of one layer's candidates are kept: scores (B, H_kv, L) (+inf: always kept), budget
    (B, H_kv), keys/values (S, L, D) per segment, seen (B,) the rows' tokens so far, row_window (B,),
    known_norms (S, L) projected value norms already computed (NaN where not) or None; returns keep
    (B, H_kv, L) bool and the norms the selection knows (or None)."""
    bsz, heads, width = scores.shape
    dim = keys.shape[-1]
    ctx = LayerContext(
        layer_idx=idx,
        key=keys.view(bsz, heads, width, dim),
        value=values.view(bsz, heads, width, dim),
        key_pos=None,
        scaling=1.0,
        lengths=seen,
        row_budget=None,
        row_window=row_window,
        observed=None,
        projection=lambda: compressor.projection(idx, module, heads, dim),
        head_priors=compressor.head_priors,
        kvzap=compressor.kvzap,
        selection_weighs_values=compressor.selection.weighs_by_value_norm,
        scorer_weighs_values=compressor.scorer_weighs_values,
        known_norms=None if known_norms is None else known_norms.view(bsz, heads, width),
    )
    selected = compressor.select(ctx, scores, budget)
    return selected.keep, selected.norms
