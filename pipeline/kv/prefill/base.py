"""The seam between the variable-length cache and its prefill strategies.

The cache (:class:`~pipeline.kv.storage.cache.VarLenCache`) routes the model's calls to the strategy of the
prefill under way and, once the context is compressed, serves decode steps itself. A strategy sees
the cache only as a :class:`PrefillTarget`: the per-layer store it fills, the chunk's positions,
the compressor, and three calls (declare a chunk, store a layer's kept entries, end the prefill).

A :class:`PrefillStrategy` answers what happens

* when a layer's K/V come in (:meth:`~PrefillStrategy.update`: what the layer's attention reads),
* when the layer's attention runs (:meth:`~PrefillStrategy.attend`: the output, and what the
  strategy keeps or compresses of the layer),
* after each forward over the context (:meth:`~PrefillStrategy.after_forward`), and
* at the end (:meth:`~PrefillStrategy.finish`, with KVzip's reconstruction scores where the
  compression waits for them: :attr:`~PrefillStrategy.awaiting_passes`).

A :class:`LayerStep` decides when one layer's dense prefill K/V become its kept entries
(:mod:`.layers`, :mod:`.streamed_budgets`); the one-pass and layer-by-layer strategies hand each
finished layer to one.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..compress import Compressor, LayerSelection, PendingLayer
from ..storage.store import VarLenLayer


class PrefillTarget(Protocol):
    """What a prefill strategy reads and writes of the cache it fills."""

    num_layers: int
    compressor: Compressor
    store: list[VarLenLayer | None]  # per layer: the kept entries, None until the layer is compressed
    chunk_pos: torch.Tensor | None  # (B, T) positions of the current forward's tokens, -1 on padding
    chunk_padding: bool
    query_pos: torch.Tensor | None  # (B, T) the positions the queries attend from (padding: just before)
    hidden_states: dict[int, torch.Tensor]  # layer -> attention input of the current forward, when wanted
    compress_seconds: float

    def begin_chunk(self, positions: torch.Tensor) -> None: ...

    def store_layer(self, idx: int, selection: LayerSelection, key, value, key_pos) -> None: ...

    def end_prefill(self) -> None: ...


class LayerStep:
    """When one layer's dense prefill K/V (B, H_kv, n, D) become its kept entries (see the module docstring)."""

    def __init__(self, target: PrefillTarget) -> None:
        self.target = target

    def add(self, idx: int, module, observed, key, value, key_pos, scaling: float) -> None:
        """Layer ``idx`` after its attention: ``observed`` is what the scorer kept of its queries,
        key_pos (B, n) its positions (-1 on padding)."""
        raise NotImplementedError

    @property
    def awaiting_passes(self) -> list[PendingLayer] | None:
        """Every layer's dense prefill, when the compression waits for reconstruction scores."""
        return None

    def finish(self, observed: list | None = None) -> None:
        raise RuntimeError("this prefill does not wait for reconstruction scores")


class PrefillStrategy:
    """One prefill over ``target`` (see the module docstring); ``layers``: the step finished layers go
    to (None for a strategy that compresses by itself)."""

    def __init__(self, target: PrefillTarget, layers: LayerStep | None = None) -> None:
        self.target = target
        self.layers = layers

    @property
    def wants_hidden_states(self) -> bool:
        """The next forward's attention inputs must be recorded (a scorer reads them)."""
        return self.target.compressor.needs_hidden_states

    def update(self, idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's new K/V (B, H_kv, T, D), post-RoPE; returns the K/V its attention reads."""
        return key, value

    def attend(self, idx: int, module, query, key, value, scaling: float) -> torch.Tensor:
        """One layer's attention over the prefill (B, H_q, T, D), and what the strategy does with the layer."""
        raise NotImplementedError

    def after_forward(self, seen: torch.Tensor) -> None:
        """After a forward over the context: ``seen`` (B,) tokens of each row so far."""

    @property
    def awaiting_passes(self) -> list[PendingLayer] | None:
        """Every layer's dense prefill, while the compression waits for KVzip's reconstruction scores
        (:meth:`finish` takes them); None otherwise."""
        return None if self.layers is None else self.layers.awaiting_passes

    def finish(self, observed: list | None = None) -> None:
        """End the prefill; ``observed``: per layer, the reconstruction scores (B, H_kv, n) it waits for."""
        if self.layers is None:
            raise RuntimeError("this prefill does not wait for reconstruction scores")
        self.layers.finish(observed)
