"""``VarLenCache``: a transformers ``Cache`` whose layers hold per-(row, KV head) variable-length K/V.

Life of a batch (driven by :class:`pipeline.engine.Engine` through :func:`run_chunk`):

1. ``run_chunk`` declares the chunk's positions (B, T), -1 on padding, and runs the model; its
   forward calls ``update`` and then the registered attention function, which calls
   :meth:`VarLenCache.attend`. Until the context is compressed both go to the prefill strategy under
   way (:attr:`VarLenCache.prefill`, :mod:`pipeline.kv.prefill`: one pass by default; the engine
   starts another with :meth:`VarLenCache.begin_prefill`), which stores each layer's kept entries in an
   exactly-sized :class:`~pipeline.kv.storage.store.VarLenLayer` and ends the prefill.
2. Later chunks (question tokens, then one token per decode step): ``update`` appends to every
   segment, :meth:`attend` runs attention over the variable-length segments with the kernel
   :func:`~pipeline.kv.attention.varlen_kernels.choose_kernel` picks (on CPU the blocked kernel, and for a
   single row's decode step the flat one; on CUDA flash-attn's varlen kernel, or without it the
   blocked kernel for decode steps and SDPA for longer chunks; the fp32
   reference when the decode cap needs probabilities). A decode step over a uniform, padding-free cache (uniform
   budgets) skips all of that: it reads a zero-copy (B, H_kv, L, D) view of the store with grouped
   matmuls (:func:`~pipeline.kv.attention.dense.grouped_decode_attention`, CPU and CUDA; SDPA if forced).
3. Optional decode-time cap (``max_cache_tokens``, :mod:`pipeline.kv.storage.decode_cap`).

The cache itself is storage, decode and rollback; :meth:`kept_positions` reads back the original
positions held for (layer, row, head).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from ..attention.dense import grouped_decode_attention, varlen_attention
from ..attention.registered import cache_keyword, recorded_attention_inputs
from ..attention.varlen_kernels import (
    KernelChoice,
    blocked_attention,
    choose_kernel,
    dense_decode_kernel,
    flash_varlen_attention,
    flat_decode_attention,
    ragged_decode_kernel,
    sdpa_varlen_attention,
)
from ..compress import Compressor, LayerSelection
from ..prefill.base import PrefillStrategy
from ..prefill.build import start_prefill
from ..prefill.rules import PrefillPlan, layer_timing
from .decode_cap import DecodeCap
from .store import VarLenLayer


class ChunkCache(Cache):
    """What every cache of this package shares: chunk positions and the parts of transformers'
    ``Cache`` API the models call. Subclasses implement :meth:`attend` (and ``update``)."""

    def __init__(self, num_layers: int) -> None:
        self.layers = []  # the base class' layer list is not used: storage is per layer in ``self.store``
        self.layer_class_to_replicate = None
        self.offloading = False
        self.num_layers = num_layers
        self.store: list[VarLenLayer | None] = [None] * num_layers
        self.chunk_pos: torch.Tensor | None = None
        self.chunk_padding = False
        self.query_pos: torch.Tensor | None = None
        self.hidden_states: dict[int, torch.Tensor] = {}  # layer -> attention input of this chunk, when wanted

    @property
    def wants_hidden_states(self) -> bool:
        """The next chunk's attention inputs must be recorded (a scorer reads them; see run_chunk)."""
        return False

    @property
    def kept_fraction(self) -> float:
        """The ``cache_size`` this cache compresses the context to (1.0: it keeps it whole)."""
        return 1.0

    def begin_chunk(self, positions: torch.Tensor) -> None:
        """Declare the positions of the next forward's tokens: (B, T) long, -1 on padding.

        Padding queries are given the position just before the row's first real token of the
        chunk so that they attend to earlier entries only (finite, ignored outputs).
        """
        positions = positions.to(torch.long)
        real = positions >= 0
        big = torch.iinfo(torch.long).max
        first = torch.where(real, positions, torch.full_like(positions, big)).min(-1, keepdim=True).values
        first = torch.where(first == big, torch.zeros_like(first), first)
        self.chunk_pos = positions
        self.chunk_padding = not bool(real.all())
        self.query_pos = torch.where(real, positions, (first - 1).clamp(min=0).expand_as(positions))

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, *args, **kwargs):
        """Called by the attention module with post-RoPE K/V (B, H_kv, T, D); passes them through."""
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        layer = self.store[layer_idx]
        return 0 if layer is None else int(layer.positions.max().item()) + 1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.num_layers

    def attend(self, module, query, key, value, scaling) -> torch.Tensor:
        raise NotImplementedError


def run_chunk(model: torch.nn.Module, cache: ChunkCache, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs):
    """One forward of ``model`` over a chunk of tokens with ``cache`` (the only way the caches of this
    package are driven). input_ids, positions: (B, T), positions -1 on padding. The model must use the
    registered attention (:func:`pipeline.kv.attention.registered.register`). Returns the model's output."""
    cache.begin_chunk(positions)
    recording = recorded_attention_inputs(model, cache.hidden_states) if cache.wants_hidden_states else nullcontext()
    try:
        with recording:
            return model(
                input_ids=input_ids,
                position_ids=positions.clamp(min=0),
                varlen_cache=cache,
                use_cache=True,
                **{cache_keyword(model): cache},
                **kwargs,
            )
    finally:
        cache.hidden_states.clear()


class VarLenCache(ChunkCache):
    """Variable-length KV cache for ``num_layers`` layers; see the module docstring."""

    def __init__(
        self, num_layers: int, compressor: Compressor, kernels: KernelChoice | None = None, compressed: bool = False
    ) -> None:
        """``compressed``: the cache will hold rows of caches that are compressed already (they join it,
        :func:`~pipeline.kv.storage.rows.regroup`), so it never prefills."""
        super().__init__(num_layers)
        self.compressor = compressor
        # decided once (by the engine, which passes its choice; else here), never per attention call
        self.kernels = kernels or KernelChoice.from_environment()
        self.compress_seconds = 0.0
        self.kernels_used: set[str] = set()  # attention paths taken after the prefill (diagnostics)
        self._appended: dict[int, torch.Tensor] = {}  # layer -> values appended by the current chunk
        self._snapshot: list | None = None
        self.context_entries: torch.Tensor | None = None  # (B,) kept entries per row after prefill
        self.context_bytes: torch.Tensor | None = None  # (B,) bytes held per row after prefill
        self.cap = DecodeCap(compressor) if compressor.config.max_cache_tokens is not None else None
        self._prefill: PrefillStrategy | None = None  # made when first needed (see prefill)
        self._compressed = compressed

    @classmethod
    def from_layers(
        cls, layers: list[VarLenLayer], compressor: Compressor, kernels: KernelChoice | None = None
    ) -> VarLenCache:
        """A cache holding already compressed layers (e.g. built by a diagnostic from its own prefill)."""
        cache = cls(len(layers), compressor, kernels)
        cache.store = list(layers)
        cache.end_prefill()
        return cache

    @property
    def kept_fraction(self) -> float:
        return self.compressor.config.cache_size

    @property
    def prefill(self) -> PrefillStrategy | None:
        """The prefill under way (:mod:`pipeline.kv.prefill`; one pass unless :meth:`begin_prefill` began
        another), None once the context is compressed. Made when first needed: a strategy refers back
        to its cache, and an idle cache holds no such cycle."""
        if self._prefill is None and not self._compressed:
            self._prefill = start_prefill(self, PrefillPlan(layers=layer_timing(self.compressor.config)))
        return self._prefill

    @property
    def wants_hidden_states(self) -> bool:
        return self.prefill is not None and self.prefill.wants_hidden_states

    def begin_prefill(
        self, plan: PrefillPlan, positions: torch.Tensor | None = None, lengths: torch.Tensor | None = None
    ) -> PrefillStrategy:
        """Prefill this empty cache with ``plan`` (:func:`pipeline.kv.prefill.rules.plan_prefill`) instead
        of one pass: a layer-by-layer prefill needs the contexts' ``positions`` (B, T), a chunked one their
        ``lengths`` (B,). Returns the strategy, through which its driver declares slices or chunks."""
        if self._compressed or any(layer is not None for layer in self.store):
            raise RuntimeError("a prefill starts from an empty cache")
        self._prefill = start_prefill(self, plan, positions, lengths)
        return self._prefill

    def end_prefill(self) -> None:
        """The context is compressed (a prefill strategy's last call): the cache serves decode steps."""
        self._prefill, self._compressed = None, True
        self.context_entries = self.entries_per_row()
        self.context_bytes = self.bytes_per_row()

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, *args, **kwargs):
        if self.prefill is not None:
            return self.prefill.update(layer_idx, key_states, value_states)
        self.store[layer_idx].append(key_states, value_states, self.chunk_pos, has_padding=self.chunk_padding)
        if self.cap is not None:  # the cap gives the new entries their norms after the attention
            self._appended[layer_idx] = value_states
        return key_states, value_states

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more entries in every segment of every layer (question + answer)."""
        for layer in self.store:
            layer.reserve(extra)

    # ------------------------------------------------------------------ attention entry point
    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Attention for one layer (B, H_q, T, D): the prefill strategy's while one is under way, else
        over the stored entries."""
        idx = module.layer_idx
        if self.chunk_pos is None:
            raise RuntimeError("VarLenCache is driven through run_chunk() (it declares the chunk's positions)")
        if self.prefill is not None:
            return self.prefill.attend(idx, module, query, key, value, scaling)
        out, kernel = self._attend_stored(idx, query, scaling)
        self.kernels_used.add(kernel)
        self._appended.pop(idx, None)
        return out

    def _attend_stored(self, idx: int, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, str]:
        layer = self.store[idx]
        track = self.cap is not None
        kernel = choose_kernel(query, need_probs=track, forced=self.kernels.varlen)
        dense = layer.dense_view() if query.shape[2] == 1 and kernel != "flash" and not track else None
        if dense is not None:
            # one new token per row over a uniform, padding-free cache: every held entry precedes it, so
            # no mask is needed and the store is read in place (grouped matmuls unless SDPA is forced)
            keys, values = dense
            if dense_decode_kernel(kernel, self.kernels.dense) == "sdpa":
                out = F.scaled_dot_product_attention(
                    query, keys.to(query.dtype), values.to(query.dtype), scale=scaling, enable_gqa=True
                )
                return out, "dense-sdpa"
            return grouped_decode_attention(query, keys, values, scaling), "dense-grouped"
        if kernel == "flash":
            return flash_varlen_attention(query, layer, scaling), kernel
        if kernel == "blocked":
            if ragged_decode_kernel(query, layer, self.kernels.ragged) == "flat":
                out = flat_decode_attention(query, layer, scaling)
                if out is not None:
                    return out, "flat"
            out = blocked_attention(query, layer, self.query_pos, scaling)
            if out is not None:
                return out, kernel
            kernel = "sdpa" if query.is_cuda else "reference"  # a layout not grown into blocks
        keys, values, key_pos = layer.padded_view()
        if kernel == "sdpa":
            return sdpa_varlen_attention(query, keys, values, key_pos, self.query_pos, scaling), kernel
        out, probs = varlen_attention(query, keys, values, key_pos, self.query_pos, scaling, return_probs=track)
        if track:
            self.cap.after_chunk(idx, layer, probs, self._appended.get(idx), self.chunk_pos >= 0)
        return out, kernel

    def store_layer(self, idx: int, selection: LayerSelection, key, value, key_pos) -> None:
        """Layer ``idx``'s kept entries (``selection.keep`` of its dense K/V (B, H_kv, n, D)) into an
        exactly-sized store (with the decode-time cap's statistics)."""
        layer = VarLenLayer.from_dense(key, value, key_pos, selection.keep)
        if self.cap is not None:
            self.cap.init_layer(layer, selection, key_pos)
        self.store[idx] = layer

    # ------------------------------------------------------------------ multi-question support
    def checkpoint(self) -> list:
        """What the cache holds now, for :meth:`rollback`: every layer's segment lengths, or full
        copies under a decode-time cap (its eviction may reorder entries)."""
        if self.cap is not None:
            return [layer.clone() for layer in self.store]
        return [layer.length.clone() for layer in self.store]

    def rollback(self, mark: list) -> None:
        """Drop every token appended since :meth:`checkpoint` returned ``mark`` (reusable)."""
        if self.cap is not None:
            self.store = [layer.clone() for layer in mark]
        else:
            for layer, length in zip(self.store, mark):
                layer.truncate(length)

    def snapshot(self) -> None:
        """Remember the compressed context so that :meth:`restore` can drop a question's tokens."""
        self._snapshot = self.checkpoint()

    def restore(self) -> None:
        if self._snapshot is None:
            raise RuntimeError("restore() without snapshot()")
        self.rollback(self._snapshot)

    # ------------------------------------------------------------------ read-back and accounting
    def kept_positions(self, layer_idx: int, row: int, head: int) -> torch.Tensor:
        """Sorted original token positions currently held for (layer, row, KV head)."""
        layer = self.store[layer_idx]
        if layer is None:
            raise RuntimeError("nothing cached yet for this layer")
        return layer.segment_positions(row, head)

    def entries_per_row(self) -> torch.Tensor:
        """(B,) live entries held per row, summed over layers and KV heads (padding excluded)."""
        return sum(layer.entries_per_row() for layer in self.store)

    def bytes_per_row(self) -> torch.Tensor:
        """(B,) bytes held per row (see :meth:`VarLenLayer.bytes_per_row`)."""
        return sum(layer.bytes_per_row() for layer in self.store)

    def used_bytes_per_row(self) -> torch.Tensor:
        """(B,) bytes of the filled slots per row (see :meth:`VarLenLayer.used_bytes_per_row`)."""
        return sum(layer.used_bytes_per_row() for layer in self.store)

    def nbytes(self) -> int:
        """Bytes of every tensor held by the cache."""
        return sum(layer.nbytes() for layer in self.store if layer is not None)
