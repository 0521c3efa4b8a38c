"""When a compression part can decide: the phases of a prefill.

Every part declares ``decides`` (:class:`Phase`), the earliest moment it has what it needs; a
method decides at the latest of its parts' phases (:func:`method_phase`). Who runs each phase:

* ``LAYER``: the prefill strategy, inside each layer's attention call: the layer's dense K/V are
  compressed before the next layer runs, so one layer's dense K/V exist at a time;
* ``PREFILL``: the prefill strategy, once the last layer's attention has run (a budget across layers
  needs every layer's scores; the dense K/V of every layer wait until then, unless the budget can be
  streamed);
* ``PASSES``: the engine (``Engine.prefill``), after the prefill forward: KVzip's context
  reconstruction passes run the model again and their scores are what the scorer ranks.

:mod:`pipeline.kv.prefill.rules` turns a method's phase into its prefill plan. With a chunked prefill
(:mod:`pipeline.kv.prefill.chunk_eviction`) the same phases repeat per chunk: ``LAYER`` parts decide
each layer right after each chunk's attention, ``PREFILL`` parts decide every layer at each chunk's
end; ``PASSES`` need the whole context and cannot be chunked.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum


class Phase(IntEnum):
    """Ordered: a later phase holds more of the prefill (and more memory) before deciding."""

    LAYER = 0
    PREFILL = 1
    PASSES = 2


def method_phase(parts: Iterable) -> Phase:
    """The phase a method decides in: the latest of its parts' ``decides``."""
    return max((part.decides for part in parts), default=Phase.LAYER)
