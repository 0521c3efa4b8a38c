"""KVzip's context-reconstruction passes, the cache side (Kim et al., arXiv 2505.23416).

After the prefill, the context's dense K/V of every layer are held (:class:`PendingLayer`). A
reconstruction pass feeds "repeat the previous context" + one chunk of the context's own tokens as
new queries (the engine builds them, :mod:`pipeline.engine.reconstruction`), and
:class:`ReconstructionCache` does, at every layer:

* the pass's attention output: its queries over the whole context plus the pass's own keys
  (causal), as the model would attend; the pass's own K/V are used and dropped, never stored;
* the score of the chunk's context entries, as KVzip defines it: a softmax over the row's sink
  entries (the chat-template prefix), the chunk's context keys and the pass's own keys (causal);
  each chunk entry scores the max of its attention weight over the pass's queries and the query
  heads of its KV group (``max`` with earlier passes' scores). With KVzip+ (kvpress's
  ``kvzip_plus_normalization``) each weight is first multiplied by ``||V_i W_O^h||_2 / ||h_j||_2``
  (the entry's projected value norm over the query's attention input norm).

Queries are processed in blocks, so the scoring temporaries stay (block x (sink + chunk + pass))
per head. The two matmuls run in the cache's dtype, as the model's own attention does (bf16 on a GPU:
tensor cores; KVzip's reference scores in the model's dtype too, softmax included); the softmax, the
weights and the scores are float32. A float32 model computes exactly what an all-float32 pass
would. Rows of a batch are left padded; a row whose context has no chunk in this pass takes part as
padding only.
"""

from __future__ import annotations

import torch

from ..compress import PendingLayer
from ..storage.cache import ChunkCache
from ..value_norms import OutputProjection

_QUERY_BLOCK = 64


def gather_positions(key_pos: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):
    """Dense indices of original positions [starts[b], ends[b]) of each left-padded row.

    key_pos: (B, n). Returns (index (B, M) long, valid (B, M) bool), M = max(ends - starts) (>= 1).
    """
    bsz, n = key_pos.shape
    pad = n - (key_pos >= 0).sum(-1)  # dense index of position p in row b is pad[b] + p
    width = max(int((ends - starts).clamp(min=0).max()) if bsz else 0, 1)
    offsets = torch.arange(width, device=key_pos.device)[None]
    valid = offsets < (ends - starts).clamp(min=0)[:, None]
    index = (pad + starts)[:, None] + offsets
    return index.clamp(max=n - 1).masked_fill(~valid, 0), valid


class ReconstructionCache(ChunkCache):
    """One reconstruction pass over pending (dense) layers; accumulates KVzip scores.

    layers: the pending layers of the prefill; chunk_start / chunk_end: (B,) original positions of
    this pass's chunk per row (start >= end: no chunk); sinks: (B,) number of leading sink entries
    per row; scores: per layer (B, H_kv, n) float32, updated in place with the max.
    """

    def __init__(self, layers: list[PendingLayer], chunk_start, chunk_end, sinks, scores, kvzip_plus=False) -> None:
        super().__init__(len(layers))
        self.context = layers
        self.chunk = gather_positions(layers[0].key_pos, chunk_start, chunk_end)
        self.sink = gather_positions(layers[0].key_pos, torch.zeros_like(sinks), sinks)
        # the same for every layer (one key layout): which entries leave the softmax, and the chunk
        # as one slice of columns when it can be
        excluded = self._excluded(layers[0].key_pos)
        self.excluded = excluded[:, None, None, :, None] if bool(excluded.any()) else None  # (B, 1, 1, n, 1)
        self.columns = self._common_columns(*self.chunk)
        self.scores = scores
        self.kvzip_plus = kvzip_plus
        self.hidden_norms: dict[int, torch.Tensor] = {}  # layer -> (B, T), set by the engine's hooks (KVzip+)
        self._projections: dict[int, OutputProjection] = {}

    def attend(self, module, query, key, value, scaling) -> torch.Tensor:
        """The pass's attention output (B, H_q, T, D); the chunk's scores as a side effect.

        One float32 softmax over context + own keys per query block gives both: the output, and the
        KVzip weights, since a softmax restricted to a subset of keys is the full softmax divided by
        the subset's mass (here: everything but the context entries outside the sinks and chunk).
        A block of queries only reads the own keys up to its last query (causal).
        """
        idx = module.layer_idx
        ctx = self.context[idx]
        bsz, h_kv, n, dim = ctx.key.shape
        h_q, t = query.shape[1], query.shape[2]
        dtype = ctx.key.dtype  # the matmuls' (see the module docstring)
        keys = torch.cat([ctx.key, key.to(dtype)], dim=2)  # (B, H_kv, n + T, D)
        values = torch.cat([ctx.value, value.to(dtype)], dim=2)
        q = (query.to(dtype) * scaling).view(bsz, h_kv, h_q // h_kv, t, dim)  # group-major, scaled once
        c_idx, c_ok = self.chunk
        self._own_padding = bool((self.chunk_pos < 0).any())
        ctx_hidden = (ctx.key_pos < 0)[:, None, None, None, :] if bool((ctx.key_pos < 0).any()) else None
        weight = self._value_weight(idx, module, ctx, c_idx) if self.kvzip_plus else None
        out = torch.empty_like(query)
        best = torch.full((bsz, h_kv, c_idx.shape[1]), float("-inf"), device=ctx.key.device)
        for begin in range(0, t, _QUERY_BLOCK):
            end = min(begin + _QUERY_BLOCK, t)
            probs = self._probs(q[:, :, :, begin:end], keys[:, :, : n + end], ctx_hidden, begin, n)
            rows = probs.reshape(bsz, h_kv, -1, n + end)  # (B, H_kv, G*Tb, n + end): one batched matmul per KV head
            pv = torch.matmul(rows.to(dtype), values[:, :, : n + end])
            out[:, :, begin:end] = pv.view(bsz, h_q, end - begin, dim)
            chunk = self._chunk_weights(probs[..., :n], self.excluded, c_idx, self.columns)  # (B, H_kv, G, Tb, M)
            if weight is not None:
                norms = self._hidden_norm(idx, slice(begin, end))[:, None, None, :, None]
                chunk = chunk * weight.view(bsz, h_kv, h_q // h_kv, 1, -1) / norms
            if self._own_padding:  # padding queries of left-padded rows score nothing
                q_ok = (self.chunk_pos[:, begin:end] >= 0)[:, None, None, :, None]
                chunk = chunk.masked_fill(~q_ok, float("-inf"))
            best = torch.maximum(best, chunk.amax(dim=(2, 3)))
        flat = best.masked_fill(~c_ok[:, None, :], float("-inf"))  # padding slots change nothing below
        self.scores[idx].scatter_reduce_(2, c_idx[:, None, :].expand(-1, h_kv, -1), flat, reduce="amax")
        return out

    def _probs(self, q, keys, ctx_hidden, begin: int, n: int) -> torch.Tensor:
        """Softmax of a scaled query block (B, H_kv, G, Tb, D) over the context and the own keys up to
        the block's end -> float32 (B, H_kv, G, Tb, n + end); the logits' matmul in the keys' dtype."""
        bsz, h_kv, groups, tb, dim = q.shape
        rows = q.reshape(bsz, h_kv, groups * tb, dim)
        logits = torch.matmul(rows, keys.transpose(-1, -2)).float().view(bsz, h_kv, groups, tb, -1)
        if ctx_hidden is not None:  # left-padded rows: their padding entries are no keys
            logits[..., :n].masked_fill_(ctx_hidden, torch.finfo(logits.dtype).min)
        end = logits.shape[-1] - n
        own_pos = self.chunk_pos[:, :end]  # (B, end)
        low = begin if not self._own_padding else 0  # own keys before the block: visible unless padding
        steps = torch.arange(begin, begin + tb, device=q.device)
        own_ok = (torch.arange(low, end, device=q.device)[None, :] <= steps[:, None])[None] & (
            own_pos[:, None, low:] >= 0
        )  # (B, Tb, end - low): causal by index (real tokens of a left-padded pass are in position order)
        logits[..., n + low :].masked_fill_(~own_ok[:, None, None], torch.finfo(logits.dtype).min)
        return torch.softmax(logits, dim=-1)

    def _excluded(self, key_pos: torch.Tensor) -> torch.Tensor:
        """(B, n) float: real context entries that are neither sinks nor in this pass's chunk."""
        (c_idx, c_ok), (s_idx, s_ok) = self.chunk, self.sink
        inside = torch.zeros(key_pos.shape, dtype=torch.bool, device=key_pos.device)
        rows = torch.arange(key_pos.shape[0], device=key_pos.device)[:, None]
        for index, ok in ((c_idx, c_ok), (s_idx, s_ok)):
            inside[rows.expand_as(index)[ok], index[ok]] = True
        return ((key_pos >= 0) & ~inside).float()

    @staticmethod
    def _common_columns(c_idx: torch.Tensor, c_ok: torch.Tensor) -> slice | None:
        """The chunk's dense columns as one slice when every row's chunk is the same full range
        (one row, or rows of equal length): the weights are then a view, not a gather."""
        first = c_idx[:, 0]
        if bool(c_ok.all()) and bool((first == first[0]).all()):
            return slice(int(first[0]), int(first[0]) + c_idx.shape[1])
        return None

    @staticmethod
    def _chunk_weights(ctx_probs, excluded, c_idx, columns: slice | None = None) -> torch.Tensor:
        """The chunk columns of the restricted softmax: full probabilities / the allowed mass (1 when
        no context entry is ``excluded``, e.g. one pass covering the whole context).
        ctx_probs: (B, H_kv, G, Tb, n) -> (B, H_kv, G, Tb, M)."""
        bsz, h_kv, groups, tb, _ = ctx_probs.shape
        if columns is not None:
            weights = ctx_probs[..., columns]
        else:
            weights = torch.gather(ctx_probs, 4, c_idx[:, None, None, None, :].expand(-1, h_kv, groups, tb, -1))
        if excluded is None:
            return weights
        mass = 1.0 - torch.matmul(ctx_probs, excluded)  # (B, H_kv, G, Tb, 1)
        return weights / mass.clamp(min=1e-30)

    def _value_weight(self, idx: int, module, ctx: PendingLayer, c_idx: torch.Tensor) -> torch.Tensor:
        """KVzip+: ||V_i W_O^h||_2 of the chunk's entries per query head, (B, H_kv, G, M)."""
        bsz, h_kv, _, dim = ctx.value.shape
        proj = self._projections.get(idx)
        if proj is None:
            proj = self._projections[idx] = OutputProjection.from_weight(module.o_proj.weight, h_kv, dim)
        values = torch.gather(ctx.value, 2, c_idx[:, None, :, None].expand(-1, h_kv, -1, dim)).float()
        quad = torch.einsum("bkmd,kgde,bkme->bkgm", values, proj.gram, values).clamp(min=0)
        return quad.sqrt()  # (B, H_kv, G, M)

    def _hidden_norm(self, idx: int, block: slice) -> torch.Tensor:
        norms = self.hidden_norms.get(idx)
        if norms is None:
            raise RuntimeError("KVzip+ needs the attention inputs' norms (the engine's hooks record them)")
        return norms[:, block].clamp(min=1e-6)
