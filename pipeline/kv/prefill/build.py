"""A :class:`~.rules.PrefillPlan` made into the strategy that runs it over one cache."""

from __future__ import annotations

import torch

from .base import LayerStep, PrefillStrategy, PrefillTarget
from .chunk_eviction import ChunkEviction
from .layer_by_layer import LayerByLayer
from .layers import AtOnce, Deferred
from .one_pass import OnePass
from .rules import PrefillPlan
from .streamed_budgets import StreamedBudgets


def layer_step(target: PrefillTarget, plan: PrefillPlan) -> LayerStep:
    """The step finished layers of a one-pass or layer-by-layer prefill go to (:mod:`.layers`)."""
    if plan.layers == "at-once":
        return AtOnce(target)
    if plan.layers == "streamed":
        return StreamedBudgets(target)
    return Deferred(target, passes=plan.layers == "after-passes")


def start_prefill(
    target: PrefillTarget,
    plan: PrefillPlan,
    positions: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> PrefillStrategy:
    """The strategy of ``plan`` over ``target``: a layer-by-layer prefill needs the contexts'
    ``positions`` (B, T) (-1 on padding), a chunked one their ``lengths`` (B,)."""
    if plan.forward == "chunks":
        if lengths is None:
            raise ValueError("a chunked prefill needs the contexts' lengths")
        return ChunkEviction(target, lengths)
    if plan.forward == "layer-by-layer":
        if positions is None:
            raise ValueError("a layer-by-layer prefill needs the contexts' positions")
        return LayerByLayer(target, layer_step(target, plan), positions)
    return OnePass(target, layer_step(target, plan))
