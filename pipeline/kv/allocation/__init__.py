"""Allocations: one module each, registered here by name (see :mod:`pipeline.kv.parts`)."""

from ..parts import Allocation, Registry
from . import adakv, headkv, layer, layerfloor, layershares, shares, uniform
from .common import row_budgets

ALLOCATIONS: Registry[Allocation] = Registry(
    "allocation",
    [
        uniform.Uniform(),
        adakv.AdaKV(),
        headkv.HeadKVAllocation(),
        layer.LayerAllocation(),
        layerfloor.LayerFloorAllocation(),
        shares.SharesAllocation(),
        layershares.LayerSharesAllocation(),
    ],
)

__all__ = ["ALLOCATIONS", "row_budgets"]
