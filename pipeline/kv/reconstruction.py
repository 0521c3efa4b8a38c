"""KVzip's context-reconstruction passes, the cache side (Kim et al., arXiv 2505.23416).

After the prefill, the context's dense K/V of every layer are held (:class:`PendingLayer`). A
reconstruction pass feeds "repeat the previous context" + one chunk of the context's own tokens as
new queries (the engine builds them, :mod:`pipeline.engine.reconstruction`), and
:class:`ReconstructionCache` does, at every layer:

* the pass's attention output: its queries over the whole context plus the pass's own keys
  (causal), as the model would attend; the pass's own K/V are used and dropped, never stored;
* the score of the chunk's context entries, as KVzip defines it: a softmax over the row's sink
  entries (the chat-template prefix), the chunk's context keys and the pass's own keys (causal), in
  float32; each chunk entry scores the max of its attention weight over the pass's queries and the
  query heads of its KV group (``max`` with earlier passes' scores). With KVzip+ (kvpress's
  ``kvzip_plus_normalization``) each weight is first multiplied by ``||V_i W_O^h||_2 / ||h_j||_2``
  (the entry's projected value norm over the query's attention input norm).

Queries are processed in blocks, so the scoring temporaries stay (block x (sink + chunk + pass))
per head. Rows of a batch are left padded; a row whose context has no chunk in this pass takes part
as padding only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import ChunkCache
from .compress import PendingLayer
from .value_norms import OutputProjection

_QUERY_BLOCK = 256


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


def pass_attention(query, ctx_key, ctx_value, ctx_pos, key, value, query_pos, scaling) -> torch.Tensor:
    """Attention of the pass's queries (B, H_q, T, D) over the context (B, H_kv, n, D) and the pass's
    own keys (B, H_kv, T, D), causally among the latter. Returns (B, H_q, T, D)."""
    own_pos = query_pos  # the pass's own keys are its tokens
    ctx_ok = (ctx_pos >= 0)[:, None, :].expand(-1, query.shape[2], -1)  # (B, T, n)
    own_ok = (own_pos[:, None, :] >= 0) & (own_pos[:, None, :] <= query_pos[:, :, None])  # (B, T, T)
    mask = torch.cat([ctx_ok, own_ok], dim=-1)[:, None]  # (B, 1, T, n + T)
    keys = torch.cat([ctx_key, key.to(ctx_key.dtype)], dim=2).to(query.dtype)
    values = torch.cat([ctx_value, value.to(ctx_value.dtype)], dim=2).to(query.dtype)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)


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
        self.scores = scores
        self.kvzip_plus = kvzip_plus
        self.hidden_norms: dict[int, torch.Tensor] = {}  # layer -> (B, T), set by the engine's hooks (KVzip+)
        self._projections: dict[int, OutputProjection] = {}

    def attend(self, module, query, key, value, scaling) -> torch.Tensor:
        idx = module.layer_idx
        ctx = self.context[idx]
        out = pass_attention(query, ctx.key, ctx.value, ctx.key_pos, key, value, self.chunk_pos, scaling)
        self._score(idx, module, query, key, scaling)
        return out

    def _score(self, idx: int, module, query, key, scaling) -> None:
        ctx = self.context[idx]
        bsz, h_kv, _, dim = ctx.key.shape
        (c_idx, c_ok), (s_idx, s_ok) = self.chunk, self.sink
        index = torch.cat([s_idx, c_idx], dim=1)  # (B, S + M)
        gathered = torch.gather(ctx.key, 2, index[:, None, :, None].expand(-1, h_kv, -1, dim)).float()
        keys = torch.cat([gathered, key.float()], dim=2)  # (B, H_kv, S + M + T, D)
        weight = self._value_weight(idx, module, ctx, c_idx) if self.kvzip_plus else None
        best = torch.full((bsz, h_kv, c_idx.shape[1]), float("-inf"), device=ctx.key.device)
        for begin in range(0, query.shape[2], _QUERY_BLOCK):
            block = slice(begin, begin + _QUERY_BLOCK)
            probs = self._chunk_probs(query[:, :, block], keys, s_ok, c_ok, self.chunk_pos[:, block], scaling)
            if weight is not None:
                probs = probs * weight[:, :, None, :] / self._hidden_norm(idx, block)[:, None, :, None]
            q_ok = (self.chunk_pos[:, block] >= 0)[:, None, :, None]
            probs = probs.masked_fill(~q_ok, float("-inf")).amax(2)  # (B, H_q, M)
            best = torch.maximum(best, probs.view(bsz, h_kv, -1, probs.shape[-1]).amax(2))
        flat = best.masked_fill(~c_ok[:, None, :], float("-inf"))  # padding slots change nothing below
        self.scores[idx].scatter_reduce_(2, c_idx[:, None, :].expand(-1, h_kv, -1), flat, reduce="amax")

    def _chunk_probs(self, q, keys, s_ok, c_ok, q_pos, scaling) -> torch.Tensor:
        """Restricted softmax of a query block over sinks + chunk + own keys -> the chunk columns
        (B, H_q, Tb, M)."""
        bsz, h_q, tb, dim = q.shape
        h_kv = keys.shape[1]
        logits = torch.matmul(q.float().reshape(bsz, h_kv, -1, dim), keys.transpose(-1, -2)) * scaling
        logits = logits.view(bsz, h_q, tb, -1)
        own_pos = self.chunk_pos
        own_ok = (own_pos[:, None, :] >= 0) & (own_pos[:, None, :] <= q_pos[:, :, None])  # (B, Tb, T)
        sel_ok = torch.cat([s_ok, c_ok], dim=1)[:, None, :].expand(-1, tb, -1)
        allowed = torch.cat([sel_ok, own_ok], dim=-1)[:, None]  # (B, 1, Tb, S + M + T)
        probs = torch.softmax(logits.masked_fill(~allowed, torch.finfo(logits.dtype).min), dim=-1)
        start = s_ok.shape[1]
        return probs[..., start : start + c_ok.shape[1]]

    def _value_weight(self, idx: int, module, ctx: PendingLayer, c_idx: torch.Tensor) -> torch.Tensor:
        """KVzip+: ||V_i W_O^h||_2 of the chunk's entries per query head, (B, H_q, M)."""
        bsz, h_kv, _, dim = ctx.value.shape
        proj = self._projections.get(idx)
        if proj is None:
            proj = self._projections[idx] = OutputProjection.from_weight(module.o_proj.weight, h_kv, dim)
        values = torch.gather(ctx.value, 2, c_idx[:, None, :, None].expand(-1, h_kv, -1, dim)).float()
        quad = torch.einsum("bkmd,kgde,bkme->bkgm", values, proj.gram, values).clamp(min=0)
        return quad.sqrt().reshape(bsz, h_kv * proj.groups, -1)

    def _hidden_norm(self, idx: int, block: slice) -> torch.Tensor:
        norms = self.hidden_norms.get(idx)
        if norms is None:
            raise RuntimeError("KVzip+ needs the attention inputs' norms (the engine's hooks record them)")
        return norms[:, block].clamp(min=1e-6)
