"""Selections: one module each, registered here by name (see :mod:`pipeline.kv.parts`)."""

from ..parts import Registry, Selection
from . import criticalkv, topk

SELECTIONS: Registry[Selection] = Registry(
    "selection",
    [
        topk.TopK(),
        criticalkv.CriticalKV(),
    ],
)
