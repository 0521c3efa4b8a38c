"""Chunked prefill with real eviction: the context goes through the model ``prefill_chunk`` tokens at
a time and the cache is compressed after every chunk, so the dense K/V of a long document never exist
at once (after Fast KVzip's chunked prefill, arXiv 2601.17668; kvpress's ``BlockPress`` only masks).

Per chunk k (positions [k*C, (k+1)*C) of every row; rows that already ended are padding):

1. each layer's attention: the chunk's queries attend to what the cache kept of the earlier chunks
   plus the chunk itself, causally (the first chunk: dense causal attention; later ones: the chunk is
   appended to the variable-length store and each segment is read in place, in blocks of queries,
   :func:`~pipeline.kv.attention.varlen_kernels.segmentwise_chunk_attention`). The scorer scores the
   chunk's own entries from the chunk alone (``observe`` on its queries / hidden states, ``score``
   with no observation window): the entries' *raw* scores, -inf on padding, +inf on sinks;
2. after the whole chunk (every layer), :meth:`ChunkEviction.after_forward` selects, per layer, from
   the union of the held entries (with the raw scores they were kept with) and the chunk's entries,
   with the method's own allocation and selection (the most recent ``window`` tokens are +inf, always
   kept) at the budget ``chunk_budget`` names:

   - ``final`` (the default): the budget the allocation gives the whole document (its length is known
     before the prefill), each head keeping at most what it has seen. A head keeps every entry until
     it holds its final count; after that an entry leaves only when the final count of better-scored
     entries is held. For a scorer whose score of an entry depends on that entry alone and a top-k
     selection, the kept set is the one a one-pass prefill would choose from the same scores (the
     scores themselves differ from one pass's only through later chunks attending to the compressed
     earlier ones). Peak: the final cache + one chunk.
   - ``running``: ``round(cache_size * seen)`` per row (``seen``: the row's tokens so far): less
     memory during the early chunks, but an early chunk keeps only the kept fraction of itself even
     where its scores are the document's best.

   A cross-layer allocation (``layer``) decides over every layer's union at once: what it holds is
   the compressed cache plus one chunk per layer. The kept entries are copied into an exactly sized
   store and the raw scores of what was kept are remembered for the next chunk, as are the projected
   value norms a selection computed for them (CriticalKV's; a value's norm never changes).

A score is the one computed when its entry's chunk went through the model: exact for scorers whose
score of an entry depends on that entry alone (``kvzap``, ``streamingllm``); ``knorm`` normalises
its scores over each chunk, and window scorers score each chunk from its own last window. Scorers
that need the whole context (``kvzip``'s reconstruction passes) are refused, as is the decode-time
cap. One chunk as long as the context keeps exactly the entries of the unchunked prefill (tested).
"""

from __future__ import annotations

import torch

from ..allocation import row_budgets
from ..attention.dense import dense_prefill_attention
from ..attention.varlen_kernels import segmentwise_chunk_attention
from ..compress import Compressor, PendingLayer
from ..parts import LayerContext
from ..phases import Phase
from ..scorers.common import window_mask
from ..storage.store import VarLenLayer
from .base import PrefillStrategy, PrefillTarget
from .held import kept_in_order, select_from_held
from .timing import BlockTimer

# attention weights (query heads x queries x entries) per call over one segment's held entries and the
# chunk: 64 MiB in fp32 where a kernel materialises them (the fused CPU and CUDA kernels do not)
WEIGHTS_PER_CALL = 1 << 24


def store_from_segments(
    sources: list[torch.Tensor], positions: torch.Tensor, keep: torch.Tensor, rows: int, heads: int
) -> VarLenLayer:
    """An exactly sized store of the kept slots of per-segment padded tensors, in slot order.
    sources: [keys, values], each (S, L, D), taken out of the list as they are copied, so the keys
    (or the old store's keys they view) are gone before the kept values' copy exists; positions:
    (S, L) (-1: no entry); keep: (S, L) bool; S = rows * heads."""
    dim = sources[0].shape[-1]
    keep = keep & (positions >= 0)
    length = keep.sum(-1).to(torch.long)
    start = torch.cumsum(length, 0) - length
    flat = keep.reshape(-1).nonzero().squeeze(1)
    keys = torch.index_select(sources.pop(0).reshape(-1, dim), 0, flat)
    values = torch.index_select(sources.pop(0).reshape(-1, dim), 0, flat)
    kept_positions = torch.index_select(positions.reshape(-1).to(torch.int32), 0, flat)
    return VarLenLayer(keys, values, kept_positions, start, length, length.clone(), rows, heads)


def held_then_chunk(held: torch.Tensor, held_count: torch.Tensor, chunk: torch.Tensor, width: int, fill: str):
    """(S, width): each segment's first ``held_count`` values of ``held`` (S, W), then its chunk's T
    values (S, T) right after them (where the store appended the chunk), ``fill`` elsewhere."""
    segments, t = chunk.shape
    out = torch.full((segments, width), float(fill), device=chunk.device, dtype=chunk.dtype)
    w = min(held.shape[1], width)
    if w:
        cols = torch.arange(w, device=chunk.device)[None, :]
        out[:, :w] = torch.where(cols < held_count[:, None], held[:, :w], out[:, :w])
    target = held_count[:, None] + torch.arange(t, device=chunk.device)[None, :]
    return out.scatter_(1, target, chunk)


def raw_scores(compressor: Compressor, idx, module, observed, key, value, key_pos, scaling, context_lengths):
    """Base scores of one prefill chunk's entries, (B, H_kv, T): as the scorer scores the chunk, except
    that the chunk's window entries get the score they have without a window (the running window is
    applied to the union in :func:`union_budgets`). context_lengths: (B,) each row's whole context."""
    layer = PendingLayer(module, key, value, key_pos, scaling, observed)
    ctx, with_window = compressor.score_layer(idx, layer, context_lengths)  # as the unchunked prefill scores it
    in_window = window_mask(key_pos, ctx.row_window)[:, None, :]
    ctx.row_window = torch.zeros_like(ctx.row_window)
    bare = compressor.scorer.score(ctx, compressor.scorer_options)  # the window's own entries, once they leave it
    return torch.where(in_window, bare, with_window)


def union_budgets(
    compressor: Compressor, positions, unions, seen: torch.Tensor, lengths: torch.Tensor, layers: list[int]
) -> tuple[list, list, torch.Tensor]:
    """Per-head counts of every layer after a prefill chunk.

    positions: per layer (S, L) original positions of the candidates (S = B * H_kv; -1: none);
    unions: per layer (S, L) raw scores; seen: (B,) tokens of each row so far (the most recent
    ``window`` of them are always kept); lengths: (B,) each row's whole context. The allocation
    splits the budget of ``lengths`` (``chunk_budget`` final) or of ``seen`` (running); no head
    keeps more than its candidates. layers: the layer indices (every layer for a cross-layer
    allocation). Returns (scores (B, H_kv, L) with the window at +inf, per layer; counts
    (B, H_kv) per layer; row windows (B,)).
    """
    cfg = compressor.config
    bsz = seen.shape[0]
    row_b, row_w = row_budgets(seen, cfg.cache_size, cfg.budget, cfg.window)
    budget_of = seen
    if cfg.chunk_budget == "final":
        budget_of = lengths.to(seen.device)
        row_b, _ = row_budgets(budget_of, cfg.cache_size, cfg.budget, cfg.window)
    scores, contexts = [], []
    for idx, pos, union in zip(layers, positions, unions):
        pos = pos.view(bsz, -1, pos.shape[-1])
        recent = (pos >= (seen - row_w)[:, None, None]) & (pos >= 0)
        scores.append(union.view(pos.shape).masked_fill(recent, float("inf")))
        priors, kvzap = compressor.head_priors, compressor.kvzap
        contexts.append(LayerContext(idx, None, None, pos, 1.0, budget_of, row_b, row_w, None, None, priors, kvzap))
    allocation, opts = compressor.allocation, compressor.allocation_options
    if compressor.phase is Phase.PREFILL:  # across layers, which hold different numbers of candidates: one width
        width = max(sc.shape[-1] for sc in scores)
        padded = [torch.nn.functional.pad(sc, (0, width - sc.shape[-1]), value=float("-inf")) for sc in scores]
        budgets = allocation.model_head_budgets(padded, contexts, opts)
    else:  # an allocation reads scores, budgets, lengths and priors, never K/V
        budgets = [allocation.head_budgets(sc, ctx, opts) for sc, ctx in zip(scores, contexts)]
    held = [(ctx.key_pos >= 0).sum(-1) for ctx in contexts]  # (B, H_kv) candidates of each head
    return scores, [torch.minimum(b.to(h.device), h) for b, h in zip(budgets, held)], row_w


class ChunkEviction(PrefillStrategy):
    """The state of one chunked prefill over ``target`` of contexts of ``lengths`` (B,) tokens (see the
    module docstring); the driver calls :meth:`after_forward` after each chunk's forward and
    :meth:`finish` after the last."""

    def __init__(self, target: PrefillTarget, lengths: torch.Tensor) -> None:
        super().__init__(target)
        self.lengths = lengths.to(torch.long)  # (B,) each row's whole context: the final budget's length
        layers = target.num_layers
        self.held_scores: list[torch.Tensor | None] = [None] * layers  # (S, W) raw scores of held entries
        # (S, W) their projected value norms where the selection computed them (NaN elsewhere), or None:
        # a value's norm does not change, so no later chunk computes it again
        self.held_norms: list[torch.Tensor | None] = [None] * layers
        self.chunk_scores: list[torch.Tensor | None] = [None] * layers  # (B, H, T) raw scores of the chunk
        self.first_chunk: dict[int, tuple] = {}  # layer -> dense (key, value, positions) of the first chunk
        self.modules: list[torch.nn.Module | None] = [None] * layers
        # a per-layer allocation decides each layer right after its attention (only that layer's chunk
        # K/V wait); a cross-layer one waits for the chunk's end (every layer's chunk K/V wait)
        self.cross_layer = target.compressor.phase is Phase.PREFILL
        self.seen: torch.Tensor | None = None  # (B,) tokens of each row up to the end of the current chunk

    def attend(self, idx: int, module, query, key, value, scaling: float) -> torch.Tensor:
        """One layer of a chunk: its attention output (B, H_q, T, D); the chunk's raw scores kept, and
        the layer compressed at once unless the allocation is cross-layer."""
        out = self._attention(idx, module, query, key, value, scaling)
        if not self.cross_layer:
            with BlockTimer(query.device) as timer:
                self._compress_layers([idx], self._seen_after_chunk())
            self.target.compress_seconds += timer.seconds
        return out

    def _seen_after_chunk(self) -> torch.Tensor:
        """(B,) each row's tokens up to the end of the current chunk (rows without tokens in it: as before)."""
        pos = self.target.chunk_pos
        last = pos.max(-1).values + 1
        if self.seen is None:
            return last.clamp(min=0)
        return torch.where(last > 0, last, self.seen)

    def _attention(self, idx: int, module, query, key, value, scaling: float) -> torch.Tensor:
        target, compressor = self.target, self.target.compressor
        pos = target.chunk_pos
        observed = compressor.observe(query, pos, idx, target.hidden_states.pop(idx, None))
        self.chunk_scores[idx] = raw_scores(compressor, idx, module, observed, key, value, pos, scaling, self.lengths)
        self.modules[idx] = module
        if target.store[idx] is None:  # the first chunk: nothing held yet, the layer's K/V wait for compression
            self.first_chunk[idx] = (key, value, pos)
            return dense_prefill_attention(query, key, value, pos, scaling)
        # update() appended the chunk to every segment of the store: one masked SDPA per segment over its
        # own entries, read in place (the decode kernels are built for a few queries; a chunk has hundreds)
        return segmentwise_chunk_attention(query, target.store[idx], target.query_pos, scaling, WEIGHTS_PER_CALL)

    def _candidates(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layer's candidates' positions (S, L) (-1: none), raw scores (S, L) and the projected value
        norms already computed for them ((S, L), NaN where not; None when none are), per segment: the
        held entries, then the chunk's (appended after them in every segment, padding included)."""
        chunk = self.chunk_scores[idx]  # (B, H, T)
        bsz, heads, t = chunk.shape
        if idx in self.first_chunk:
            pos = self.first_chunk[idx][2]
            positions = pos[:, None, :].expand(bsz, heads, t).reshape(bsz * heads, t)
            return positions, chunk.reshape(bsz * heads, t).masked_fill(positions < 0, float("-inf")), None
        layer = self.target.store[idx]
        index, live = layer.padded_index()
        positions = torch.index_select(layer.positions, 0, index.reshape(-1)).view(index.shape).long()
        positions = positions.masked_fill(~live, -1)
        held_count = layer.length - t
        scores = held_then_chunk(self.held_scores[idx], held_count, chunk.reshape(-1, t), positions.shape[1], "-inf")
        scores = scores.masked_fill(positions < 0, float("-inf"))
        held_norms = self.held_norms[idx]
        if held_norms is None:
            return positions, scores, None
        unknown = torch.full_like(chunk.reshape(-1, t), float("nan"))
        return positions, scores, held_then_chunk(held_norms, held_count, unknown, positions.shape[1], "nan")

    def _keys_values(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's candidates' keys and values (S, L, D), aligned with :meth:`_candidates`, taken
        out of the cache: the layer is rebuilt from them, and where they are a gathered copy (uneven
        per-head counts) the old store would otherwise sit beside them until the new one exists."""
        if idx in self.first_chunk:
            key, value, _ = self.first_chunk.pop(idx)
            return key.reshape(-1, key.shape[2], key.shape[3]), value.reshape(-1, value.shape[2], value.shape[3])
        layer, self.target.store[idx] = self.target.store[idx], None
        keys, values, _ = layer.padded_view(release=True)  # a gathered copy: one old buffer less at the peak
        return keys, values

    def update(self, idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After the first chunk the chunk's K/V are appended to every segment of the layer's store
        (exactly this chunk's slots, for this layer only: no slack); the attention reads them there."""
        layer = self.target.store[idx]
        if layer is not None:
            layer.reserve(key.shape[2])
            layer.append(key, value, self.target.chunk_pos, has_padding=self.target.chunk_padding)
        return key, value

    def after_forward(self, seen: torch.Tensor) -> None:
        """After a chunk's forward (``seen``: (B,) tokens of each row so far): a cross-layer allocation
        selects every layer's kept entries now (timed; per-layer ones did in :meth:`attend`)."""
        with BlockTimer(seen.device) as timer:
            if self.cross_layer:
                self._compress_layers(list(range(self.target.num_layers)), seen)
            self.seen = seen
        self.target.compress_seconds += timer.seconds

    def finish(self, observed: list | None = None) -> None:
        """After the last chunk: the context is compressed."""
        self.target.end_prefill()

    def _compress_layers(self, layers: list[int], seen: torch.Tensor) -> None:
        """Select the kept entries of ``layers`` from held + chunk at the running budget; each store
        becomes exactly its kept entries. Budgets are decided from the layers' scores first; then one
        layer's candidate K/V exist at a time."""
        compressor = self.target.compressor
        bsz, heads = self.chunk_scores[layers[0]].shape[:2]
        positions, unions, known = zip(*(self._candidates(idx) for idx in layers))
        scores, budgets, row_window = union_budgets(compressor, positions, unions, seen, self.lengths, layers)
        for j, idx in enumerate(layers):
            sources = list(self._keys_values(idx))  # [keys, values]: emptied by store_from_segments
            module = self.modules[idx]
            keep, norms = select_from_held(
                compressor, idx, module, scores[j], budgets[j], *sources, seen, row_window, known[j]
            )
            keep = keep.reshape(positions[j].shape) & (positions[j] >= 0)
            self.target.store[idx] = store_from_segments(sources, positions[j], keep, bsz, heads)
            self.held_scores[idx] = kept_in_order(unions[j], keep)
            self.held_norms[idx] = None if norms is None else kept_in_order(norms.reshape(keep.shape), keep, "nan")
            self.chunk_scores[idx] = None
