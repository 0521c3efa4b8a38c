"""Allocations: one module each, registered here by name (see :mod:`pipeline.kv.parts`)."""

from ..parts import Allocation, Registry
from . import adakv, headkv, layer, shares, uniform
from .common import row_budgets

ALLOCATIONS: Registry[Allocation] = Registry(
    "allocation",
    [
        uniform.Uniform(),
        adakv.AdaKV(),
        headkv.HeadKVAllocation(),
        layer.LayerAllocation(),
        shares.SharesAllocation(),
    ],
)

__all__ = ["ALLOCATIONS", "row_budgets"]
