"""Which prefill a compression runs (:func:`plan_prefill`), and every rule about what goes together.

A prefill makes two choices (:class:`PrefillPlan`):

* ``forward`` -- how the model goes over the context:

  - ``one-pass``: the model's own forward over the whole context (:mod:`.one_pass`);
  - ``layer-by-layer``: every layer over the whole context in token slices before the next layer,
    the same kept entries as one pass without the whole context's activations (:mod:`.layer_by_layer`;
    asked for by the model's ``layerwise_prefill``);
  - ``chunks``: the context ``prefill_chunk`` tokens at a time, the cache compressed after each chunk,
    so the dense K/V of the whole context never exist (:mod:`.chunk_eviction`; it chooses its kept
    entries per chunk itself);

* ``layers`` -- when a layer's dense K/V become its kept entries, for the first two (:mod:`.layers`):

  - ``at-once``: right after the layer's attention (every part decides in ``Phase.LAYER``);
  - ``streamed``: a cross-layer budget decided as the layers come, earlier layers shrunk
    (:mod:`.streamed_budgets`);
  - ``deferred``: every layer held until the last layer's attention (a cross-layer budget that
    cannot stream);
  - ``after-passes``: every layer held until the engine brings KVzip's reconstruction scores.

The rules live here and nowhere else: :func:`config_refusal` (fields that cannot go together, checked
when a :class:`~pipeline.kv.config.CompressionConfig` is built), :func:`layer_by_layer_refusal` (why
a layer-by-layer prefill falls back to one pass), :func:`streams` and :func:`shares_capture` (whether
a sweep's setting can be built from the shared dense capture, :mod:`.capture`). This module imports
nothing of the package but the phases: the config calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from ..phases import Phase

Forward = Literal["one-pass", "layer-by-layer", "chunks"]
LayerTiming = Literal["at-once", "streamed", "deferred", "after-passes"]


class MethodSettings(Protocol):
    """What the rules read of a :class:`~pipeline.kv.config.CompressionConfig`."""

    method: str
    compresses: bool
    phase: Phase
    prefill_chunk: int | None
    max_cache_tokens: int | None

    def parts(self) -> list: ...


@dataclass(frozen=True)
class PrefillPlan:
    """The prefill one cache runs: ``forward``, ``layers`` (see the module docstring) and the tokens
    per slice (``layer-by-layer``) or per chunk (``chunks``), 0 for one pass."""

    forward: Forward = "one-pass"
    layers: LayerTiming = "at-once"
    tokens: int = 0


def config_refusal(config: MethodSettings) -> str | None:
    """Why the config's own fields cannot go together (None: they can)."""
    if config.prefill_chunk is None or not config.compresses:
        return None
    if config.phase is Phase.PASSES:
        return (
            f"prefill_chunk: scorer {config.parts()[0].name!r} scores from passes over the whole context and "
            "cannot compress chunk by chunk; use kvzap (its one-pass predictor) or another scorer"
        )
    if config.max_cache_tokens is not None:
        return "prefill_chunk and max_cache_tokens (the decode-time cap) cannot be combined"
    return None


def streams(config: MethodSettings) -> bool:
    """A cross-layer method whose layers can be compressed as they come (:mod:`.streamed_budgets`): a
    scorer that scores each layer in its own attention, an allocation that ``streams``, a ``nested``
    selection; not under the decode-time cap (it starts from one selection's norms of every kept entry)."""
    if not config.compresses or config.phase is not Phase.PREFILL or config.max_cache_tokens is not None:
        return False
    scorer, allocation, selection = config.parts()
    return scorer.decides is Phase.LAYER and allocation.streams and selection.nested


def layer_timing(config: MethodSettings) -> LayerTiming:
    """When a layer's dense K/V become its kept entries in a one-pass or layer-by-layer prefill."""
    if config.phase is Phase.LAYER:
        return "at-once"
    if config.phase is Phase.PASSES:
        return "after-passes"
    return "streamed" if streams(config) else "deferred"


def layer_by_layer_refusal(config: MethodSettings) -> str | None:
    """Why ``config`` cannot be prefilled layer by layer (None: it can)."""
    if config.max_cache_tokens is not None:
        return "a layer-by-layer prefill cannot use the decode-time cap"
    if config.compresses and not config.parts()[0].observes_in_slices:
        return f"{config.method!r} observes every query at once: prefill it in one pass"
    return None


def shares_capture(config: MethodSettings) -> bool:
    """Whether a sweep can build this setting's cache from its one shared dense prefill: not a chunked
    one (its later chunks attend to its own compressed cache)."""
    return not (config.compresses and config.prefill_chunk is not None)


def plan_prefill(config: MethodSettings, layer_slice: int = 0, context_length: int = 0) -> PrefillPlan:
    """The prefill of a cache compressing with ``config`` over contexts of ``context_length`` columns
    (the longest row, padding included); ``layer_slice``: the tokens per slice of a layer-by-layer
    prefill the model asks for and supports (0: off). A refused layer-by-layer prefill, or a context
    no longer than one slice, runs in one pass."""
    reason = config_refusal(config)
    if reason is not None:
        raise ValueError(reason)
    if config.compresses and config.prefill_chunk is not None:
        return PrefillPlan("chunks", layer_timing(config), config.prefill_chunk)
    if 0 < layer_slice < context_length and layer_by_layer_refusal(config) is None:
        return PrefillPlan("layer-by-layer", layer_timing(config), layer_slice)
    return PrefillPlan("one-pass", layer_timing(config))
