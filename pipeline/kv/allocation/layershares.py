"""Each document's cross-layer counts shrunk toward the calibrated table: the mean of the ``layer``
allocation's counts (one top-k over every layer's and KV head's scores of the row, arXiv 2510.13334;
KVzip's global budget, arXiv 2505.23416) and the ``shares`` allocation's (what that top-k over KVzip's
own scores gave each (layer, head) on average in the calibration), rounded down.

Over the learned scorer's *predicted* scores the per-document counts win at small caches and lose at
0.4 to the table (``docs/results/kvzap-layer``): a shrinkage estimate, half the document's own
allocation and half the population's, with the weight fixed at one half (not tuned).

Streams like ``layer`` (:mod:`pipeline.kv.streamed`): the table's counts of a layer are fixed, and the
``layer`` counts among the first layers bound their final counts from above, so the mean does too. The
total kept stays at most ``L * H_kv * b`` per row, plus half of the table's window floors.
"""

from __future__ import annotations

import torch

from ..kvzap_model import KVzapModelOptions
from ..parts import LayerContext
from .layer import CrossLayerAllocation, layer_head_budgets
from .shares import table_counts


def shrunk_to_table(counts: list[torch.Tensor], contexts: list[LayerContext]) -> list[torch.Tensor]:
    """counts: per layer (B, H_kv) of the ``layer`` allocation; contexts: those layers' contexts (the
    layer index, the rows' budgets, windows and lengths, the KVzap file's shares). Returns per layer
    (B, H_kv) long ``floor((counts + table counts) / 2)``; the table is computed once for all layers."""
    table = table_counts(contexts[0])  # (B, L, H_kv)
    return [torch.div(c + table[:, ctx.layer_idx], 2, rounding_mode="floor") for c, ctx in zip(counts, contexts)]


class LayerSharesAllocation(CrossLayerAllocation):
    name = "layershares"
    options = KVzapModelOptions
    needs_kvzap_model = True
    summary = "mean of the layer allocation's counts and the calibrated shares table's (shrinkage)"

    def counts(self, scores, contexts, num_layers, options: KVzapModelOptions) -> list[torch.Tensor]:
        return shrunk_to_table(layer_head_budgets(scores, contexts[0].row_budget, num_layers), contexts)
