"""When one layer's dense prefill K/V become its kept entries, in a one-pass or layer-by-layer prefill:

* :class:`AtOnce` -- right after the layer's attention (every part decides in ``Phase.LAYER``), so
  one layer's dense K/V exist at a time;
* :class:`Deferred` -- every layer held (:class:`~pipeline.kv.compress.PendingLayer`) and compressed
  together after the last layer's attention (a cross-layer budget, ``Phase.PREFILL``) or when the
  engine brings KVzip's reconstruction scores (``Phase.PASSES``): the dense cache of every layer
  exists until then;
* :class:`~.streamed_budgets.StreamedBudgets` -- a cross-layer budget decided as the layers come.

Each step times its compression (scoring, selection, copying) into the target's ``compress_seconds``
and ends the prefill once the last layer is stored.
"""

from __future__ import annotations

from ..compress import PendingLayer
from .base import LayerStep, PrefillTarget
from .timing import BlockTimer


class AtOnce(LayerStep):
    """Each layer compressed right after its attention."""

    def add(self, idx: int, module, observed, key, value, key_pos, scaling: float) -> None:
        target = self.target
        with BlockTimer(key.device) as timer:
            selection = target.compressor.compress_observed(idx, module, observed, key, value, key_pos, scaling)
            target.store_layer(idx, selection, key, value, key_pos)
        target.compress_seconds += timer.seconds
        if idx == target.num_layers - 1:
            target.end_prefill()


class Deferred(LayerStep):
    """Every layer held until the last one (``passes`` False) or until :meth:`finish` brings the
    reconstruction scores (``passes`` True)."""

    def __init__(self, target: PrefillTarget, passes: bool) -> None:
        super().__init__(target)
        self.passes = passes
        self.pending: list[PendingLayer | None] = [None] * target.num_layers

    def add(self, idx: int, module, observed, key, value, key_pos, scaling: float) -> None:
        if self.pending[idx] is not None:
            raise RuntimeError(
                "the context is not compressed yet: run the reconstruction passes and finish() the prefill"
            )
        self.pending[idx] = PendingLayer(module, key, value, key_pos, scaling, observed)
        if idx == self.target.num_layers - 1 and not self.passes:
            self.finish()

    @property
    def awaiting_passes(self) -> list[PendingLayer] | None:
        return self.pending if self.passes and self.pending[-1] is not None else None

    def finish(self, observed: list | None = None) -> None:
        """Compress every held layer at once; ``observed``: per layer, the reconstruction scores (B, H_kv, n)
        that replace what the prefill observed. The dense K/V are dropped afterwards."""
        if any(layer is None for layer in self.pending):
            raise RuntimeError("the prefill's compression needs every layer prefilled")
        if observed is not None:
            for layer, obs in zip(self.pending, observed):
                layer.observed = obs
        target = self.target
        with BlockTimer(self.pending[0].key.device) as timer:
            selections = target.compressor.compress_model(self.pending)
            for idx, (layer, selection) in enumerate(zip(self.pending, selections)):
                target.store_layer(idx, selection, layer.key, layer.value, layer.key_pos)
        target.compress_seconds += timer.seconds
        self.pending = [None] * target.num_layers
        target.end_prefill()
