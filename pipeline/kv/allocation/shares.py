"""Calibrated cross-layer shares: KVzip's global budget (one top-k over every layer and head,
arXiv 2505.23416; the ``layer`` allocation) without holding the dense cache.

The ``layer`` allocation needs every layer's scores before any layer is compressed, so the dense
cache of the whole prefill exists at once. Here the calibration (``jobs/calibrate_kvzap.py``)
records what that global top-k gives each (layer, KV head) on average (or the counts that keep the
most true score under the predictor's ranking, ``--shares-target predicted``), as a share of the row's
pool at a few kept fractions, optionally per context length
(:meth:`~pipeline.kv.kvzap_model.KVzapModel.shares_at` interpolates at the row's own fraction b / n
and length n). Each layer's counts then follow from the shares alone, right after its attention:
the pool ``L * H * b`` is split as ``min(n, c * share_lh)`` with ``c`` chosen by water-filling (what
a saturated head cannot use goes to the others), rounded down and raised to the window. The total
kept stays at most ``L * H * b`` per row (plus the window floor of heads whose share is below it).
Scorer-agnostic; the shares ship in the KVzap file.
"""

from __future__ import annotations

import torch

from ..kvzap_model import KVzapModelOptions
from ..parts import Allocation, LayerContext
from .headkv import water_fill


def shares_counts(
    shares: torch.Tensor, row_budget: torch.Tensor, row_window: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """shares: (B, L, H) non-negative per row -> (B, L, H) long counts of every layer (one water-fill
    of the row's pool per row)."""
    out = []
    for b in range(row_budget.numel()):
        weight = shares[b].double().clamp(min=0)
        layers, heads = weight.shape
        if float(weight.sum()) <= 0:
            weight = torch.ones_like(weight)
        alloc = water_fill(weight.reshape(-1), float(row_budget[b]) * weight.numel(), float(lengths[b]))
        counts = torch.floor(alloc.view(layers, heads) + 1e-9).long()
        out.append(counts.clamp(min=int(row_window[b]), max=int(lengths[b])))
    return torch.stack(out).to(row_budget.device)


def table_counts(ctx: LayerContext) -> torch.Tensor:
    """(B, L, H_kv) long counts of every layer from the KVzap file's shares at each row's kept fraction
    and length (needs only the context's budgets, windows, lengths and KVzap model, the same for every
    layer of a row)."""
    if ctx.kvzap is None:
        raise ValueError("the shares table needs a KVzap model file (compression.kvzap_model)")
    fractions = ctx.row_budget.double() / ctx.lengths.clamp(min=1).double()
    shares = ctx.kvzap.shares_at(fractions, ctx.lengths)
    return shares_counts(shares, ctx.row_budget, ctx.row_window, ctx.lengths)


class SharesAllocation(Allocation):
    name = "shares"
    options = KVzapModelOptions
    summary = "per-(layer, head) shares of KVzip's global top-k, calibrated offline (no dense cache held)"
    needs_kvzap_model = True

    def head_budgets(self, scores: torch.Tensor, ctx: LayerContext, options: KVzapModelOptions) -> torch.Tensor:
        return table_counts(ctx)[:, ctx.layer_idx]
