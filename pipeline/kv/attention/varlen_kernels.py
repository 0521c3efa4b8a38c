"""Attention kernels over the variable-length cache: which one runs, and the two accelerator paths.

The cache (:class:`~pipeline.kv.storage.store.VarLenLayer`) holds every (row, KV head) pair as its own
sequence of kept entries in one flat buffer. Three ways to read it, all computing the same
function (key j visible to query q iff ``0 <= pos_j <= pos_q``):

* ``reference`` (:func:`pipeline.kv.attention.dense.varlen_attention`): padded (S, L) view, fp32
  logits and softmax. The only one that can return the attention probabilities, which the
  decode-time cap needs; the CPU default.
* ``sdpa`` (:func:`sdpa_varlen_attention`): the same padded view and a boolean mask through
  ``torch.nn.functional.scaled_dot_product_attention``, each segment one "batch" with its group's
  G query heads sharing one KV head (``enable_gqa``); in bf16/fp16 on CUDA this dispatches to the
  memory-efficient kernel and never materialises fp32 logits. CUDA's kernel for chunks of several
  tokens (questions) without flash-attn. Not for decode steps: the padded view is a gather of the
  whole ragged cache per layer and step (on an H200, a batch of 20 % caches filling 40 GiB decoded
  at 216 ms per step at 8K tokens and 517 ms at 32K this way, 59 and 57 ms with ``blocked``).
* ``flash`` (:func:`flash_varlen_attention`): flash-attn's ``flash_attn_varlen_func`` with each
  segment as one sequence of ``nheads_k = 1`` and its G query heads (``nheads = G``): keys packed as
  (N, 1, D) with ``cu_seqlens_k`` from the segment lengths, queries as (S*T, G, D). It needs keys
  of one segment back to back with no padding entries in between; that is a zero-copy view of the
  store right after compression (segments exactly sized and adjacent), otherwise the live entries
  are gathered first (one extra copy of the kept cache per layer and step). New tokens are the
  last T entries of every segment in order, so flash-attn's causal mask (aligned to the bottom
  right when ``seqlen_q != seqlen_k``) is exactly the position rule; padding tokens of
  left-padded rows are left out of the keys, which keeps that alignment right for the real
  queries. Used on CUDA for fp16/bf16 when ``flash_attn`` is installed.

* ``blocked`` (:func:`blocked_attention`): new tokens over a ragged cache, read in place through
  the store's block view (every segment a run of ``BLOCK``-slot blocks):
  the queries are gathered per block (G x D floats per block, not the keys), logits and
  probability-weighted values are batched matmuls per block, and the softmax's max and sum are
  reduced per segment with ``scatter_reduce`` / ``index_add``. Nothing of the cache is copied, so a
  ragged cache costs what its entries cost. The CPU path after the prefill (question chunks and
  decode steps) and CUDA's decode path when flash-attn is not installed; on both, uniform caches'
  decode steps read a dense view with grouped matmuls instead (``dense_decode_kernel``).
* ``flat`` (:func:`flat_decode_attention`): one new token of a single-row ragged cache. Every query
  head is multiplied with all slots of the layer's flat buffer in one matmul, and the slots of
  other KV heads' segments, padding and unused capacity are masked with the store's cached
  additive :meth:`~pipeline.kv.storage.store.VarLenLayer.head_bias`. That is H_kv times the dot products
  the segments need, in 4 ops instead of the blocked kernel's ~20: on SmolLM2 (3 KV heads) at one
  row a layer's step costs what the grouped matmuls over a uniform cache cost, where the blocked
  kernel costs about 2x. With several rows the waste grows with the rows (all rows' slots), so
  batches keep the blocked kernel, and so do long single rows (``FLAT_MAX_MASKED``). The CPU
  default for single-row ragged decode steps (``CRITICALKV_RAGGED_DECODE=flat|blocked`` forces one).

A later chunk of a chunked prefill (hundreds of queries per row over a ragged store) takes none of
these: :func:`segmentwise_chunk_attention` reads each segment in place with one SDPA call per block of
queries.

``choose_kernel`` picks one per call from the call's shape and device; ``dense_decode_kernel`` how a
decode step reads a uniform cache's dense view, ``ragged_decode_kernel`` whether a single-row ragged
decode step takes ``flat`` or ``blocked``. A :class:`KernelChoice`, fixed when a cache is made, may
force each of them (benchmarks, the GPU check); by default it is read once from the environment
(``CRITICALKV_VARLEN_KERNEL=reference|sdpa|flash|blocked``, ``CRITICALKV_DENSE_DECODE=grouped|sdpa``,
``CRITICALKV_RAGGED_DECODE=flat|blocked``), never per call. The flash path's
packing is tested on CPU against a plain per-sequence implementation of
``flash_attn_varlen_func``'s documented semantics (``tests/kv/test_varlen_kernels.py``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KERNEL_ENV = "CRITICALKV_VARLEN_KERNEL"
KERNELS = ("reference", "sdpa", "flash", "blocked")
DENSE_ENV = "CRITICALKV_DENSE_DECODE"
DENSE_KERNELS = ("grouped", "sdpa")
RAGGED_ENV = "CRITICALKV_RAGGED_DECODE"
RAGGED_KERNELS = ("flat", "blocked")
# flat by default while H_kv x slots <= this: where its H_kv-fold dot products stop beating the blocked
# kernel on SmolLM2 (benchmarks/ragged_decode.py; the figures are in docs/BENCHMARKS.md)
FLAT_MAX_MASKED = 12288
# queries per call of a prefill chunk over its segment: each block reads the chunk's keys only up to its
# own last query, which skips most of the chunk's causal upper half (benchmarks/method_costs.py)
CHUNK_QUERY_BLOCK = 256
# elements of a blocked call's temporaries (per block and query head: the gathered query and the weighted
# values, D each, the logits and probabilities, W each): 4 MiB in fp32. A question of T tokens over a long
# cache runs in query slices instead of materialising them for all T at once. (Counting only the logits
# let the four reach 6x that with D = 64 and W = 32: 24 MiB per call, the peak of an 8K run after a chunked prefill.)
BLOCKED_ELEMENTS_PER_CALL = 1 << 20


@functools.lru_cache(maxsize=1)
def flash_varlen_function() -> Callable | None:
    """flash-attn's ``flash_attn_varlen_func`` when the package imports, else None (looked up once:
    it is asked per layer and step, and a failed import is not cached by Python)."""
    try:
        from flash_attn import flash_attn_varlen_func  # optional, CUDA-only dependency: looked up lazily
    except Exception:  # noqa: BLE001 - not installed, or built for another torch/CUDA
        return None
    return flash_attn_varlen_func


@dataclass(frozen=True)
class KernelChoice:
    """The kernels a cache is forced to use after its prefill (None: chosen per call, see the
    module docstring); checked when made."""

    varlen: str | None = None  # one of KERNELS
    dense: str | None = None  # one of DENSE_KERNELS
    ragged: str | None = None  # one of RAGGED_KERNELS

    def __post_init__(self) -> None:
        for value, allowed, variable in (
            (self.varlen, KERNELS, KERNEL_ENV),
            (self.dense, DENSE_KERNELS, DENSE_ENV),
            (self.ragged, RAGGED_KERNELS, RAGGED_ENV),
        ):
            if value is not None and value not in allowed:
                raise ValueError(f"{variable}={value!r}: expected one of {', '.join(allowed)}")

    @classmethod
    def from_environment(cls, environ=None) -> KernelChoice:
        """The choice the three variables force (unset or empty: none)."""
        env = os.environ if environ is None else environ
        forced = [env.get(name, "").strip().lower() or None for name in (KERNEL_ENV, DENSE_ENV, RAGGED_ENV)]
        return cls(*forced)


def choose_kernel(query: torch.Tensor, need_probs: bool, forced: str | None = None) -> str:
    """The kernel for one call (query: (B, H_q, T, D)): ``forced``, else on CPU ``blocked``, on CUDA
    ``flash`` with fp16/bf16 and flash-attn installed, otherwise ``blocked`` for a decode step (T = 1)
    and ``sdpa`` for longer chunks. Calls that need probabilities (the decode cap) always use
    ``reference``."""
    if need_probs:
        return "reference"
    if forced:
        return forced
    if not query.is_cuda:
        return "blocked"
    if query.dtype in (torch.float16, torch.bfloat16) and flash_varlen_function() is not None:
        return "flash"
    return "blocked" if query.shape[2] == 1 else "sdpa"


def dense_decode_kernel(kernel: str, forced: str | None = None) -> str:
    """How one new token per row reads a uniform, padding-free cache's dense view, given the
    ``kernel`` :func:`choose_kernel` picked for the call: ``forced``, else ``sdpa`` when that kernel
    is sdpa, else ``grouped`` (:func:`pipeline.kv.attention.dense.grouped_decode_attention`), on CUDA too:
    on an H200 (torch 2.11, bf16, random Llama-3.1-8B shape at 32K, steps interleaved) a 20 % cache's
    step took 23.1 ms grouped against 58.3 ms through SDPA at one row and 26.3 against 59.8 ms at
    nine; SDPA's step costs the same whatever the cache holds (host bound), grouped matmuls do not
    (``docs/results/gpu/README.md``)."""
    if forced:
        return forced
    return "sdpa" if kernel == "sdpa" else "grouped"


def ragged_decode_kernel(query: torch.Tensor, layer, forced: str | None = None) -> str:
    """``flat`` or ``blocked`` for a decode step the blocked kernel would take: ``flat`` for one token
    of a single-row layer of at most ``FLAT_MAX_MASKED`` KV heads x slots, ``blocked`` otherwise;
    ``forced`` picks one (flat still needs one row and one token)."""
    if layer.num_rows != 1 or query.shape[2] != 1 or forced == "blocked":
        return "blocked"
    small = layer.num_heads * layer.keys.shape[0] <= FLAT_MAX_MASKED
    return "flat" if small or forced == "flat" else "blocked"


def flat_decode_attention(query: torch.Tensor, layer, scaling: float) -> torch.Tensor | None:
    """One new token of a single-row, block-aligned ``layer`` (its own entry already appended), every
    query head against the whole flat buffer, masked by ``layer.head_bias()`` to the live entries of
    its KV head's segment (see the module docstring).

    query: (1, H_q, 1, D). Returns (1, H_q, 1, D), or None when the layout is not block aligned.
    """
    bias = layer.head_bias()
    if bias is None:
        return None
    _, h_q, _, dim = query.shape
    q = query.reshape(h_q, dim).to(layer.keys.dtype)
    logits = torch.mm(q, layer.keys.T).float().mul_(scaling).view(layer.num_heads, h_q // layer.num_heads, -1)
    probs = logits.add_(bias[:, None]).softmax(-1).view(h_q, -1)
    return torch.mm(probs.to(layer.values.dtype), layer.values).view(1, h_q, 1, dim).to(query.dtype)


def blocked_attention(
    query: torch.Tensor, layer, query_pos: torch.Tensor, scaling: float, max_elements: int = BLOCKED_ELEMENTS_PER_CALL
) -> torch.Tensor | None:
    """Attention of T new tokens per row over a block-aligned ``layer`` (the chunk's own entries
    already appended), read in place: key j is visible to query q iff ``0 <= pos_j <= pos_q`` and
    j is a live slot of q's segment. The queries go in slices whose temporaries (gathered queries,
    logits, probabilities, weighted values) hold at most ``max_elements`` elements (every query is
    attended alone: slicing changes nothing but the temporaries).

    query: (B, H_q, T, D); query_pos: (B, T). Returns (B, H_q, T, D), or None when the layout is
    not block aligned.
    """
    table = layer.block_table()
    if table is None:
        return None
    t = query.shape[2]
    blocks, width = table[1].shape
    per_query = blocks * (query.shape[1] // layer.num_heads) * 2 * (query.shape[3] + width)
    step = max(1, max_elements // max(per_query, 1))
    if t <= step:
        return _blocked_slice(query, layer, table, query_pos, scaling, causal=t > 1)
    pieces = [
        _blocked_slice(query[:, :, s : s + step], layer, table, query_pos[:, s : s + step], scaling, causal=True)
        for s in range(0, t, step)
    ]
    return torch.cat(pieces, dim=2)


def _blocked_slice(query: torch.Tensor, layer, table, query_pos: torch.Tensor, scaling: float, causal: bool):
    """:func:`blocked_attention` of one slice of queries; ``table``: the layer's block table;
    ``causal``: the slice is part of a chunk whose later tokens are appended (else one decode token,
    which every held entry precedes)."""
    segment, slot = table
    bsz, h_q, t, dim = query.shape
    segments, groups = layer.num_segments, h_q // layer.num_heads
    blocks, width = slot.shape
    key_pos = layer.positions.view(blocks, width)
    live = (slot < layer.length[segment][:, None]) & (key_pos >= 0)  # (N, W)
    if causal:  # causal inside the chunk: (N, T, W)
        qpos = query_pos[:, None, :].expand(bsz, layer.num_heads, t).reshape(segments, t).index_select(0, segment)
        live = live[:, None, :] & (key_pos[:, None, :] <= qpos[:, :, None])
    else:  # one token: every held entry precedes it
        live = live[:, None, :]
    q = query.reshape(segments, groups, t, dim).index_select(0, segment).to(layer.keys.dtype)  # (N, G, T, D)
    keys, values = layer.keys.view(blocks, width, dim), layer.values.view(blocks, width, dim)
    logits = torch.bmm(q.view(blocks, groups * t, dim), keys.transpose(1, 2)).float().mul_(scaling)
    logits = logits.view(blocks, groups, t, width).masked_fill_(~live[:, None], float("-inf"))
    logits = logits.view(blocks, groups * t, width)  # (N, G*T, W)
    rows = groups * t
    top = torch.full((segments, rows), float("-inf"), device=query.device)
    top.scatter_reduce_(0, segment[:, None].expand(blocks, rows), logits.amax(-1), "amax")
    top = top.clamp_min(torch.finfo(top.dtype).min)  # a block (or a query) seeing nothing stays finite
    probs = torch.exp(logits - top.index_select(0, segment)[..., None])  # masked slots 0
    total = torch.zeros(segments, rows, device=query.device).index_add_(0, segment, probs.sum(-1))
    weighted = torch.bmm(probs.to(values.dtype), values)  # (N, G*T, D)
    out = torch.zeros(segments, rows, dim, dtype=weighted.dtype, device=query.device)
    out.index_add_(0, segment, weighted)
    out = out / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None].to(out.dtype)
    return out.view(bsz, h_q, t, dim).to(query.dtype)


def sdpa_varlen_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """SDPA over the padded view of the variable-length cache.

    query: (B, H_q, T, D); keys/values: (S, L, D), S = B * H_kv; key_pos: (S, L) (-1 = no entry);
    query_pos: (B, T). Returns (B, H_q, T, D) in the query's dtype.
    """
    bsz, h_q, t, dim = query.shape
    segments, length, _ = keys.shape
    h_kv = segments // bsz
    groups = h_q // h_kv
    q = query.reshape(segments, groups, t, dim)
    qpos = query_pos[:, None, :].expand(bsz, h_kv, t).reshape(segments, 1, t, 1)
    kpos = key_pos[:, None, None, :]
    allowed = (kpos >= 0) & (kpos <= qpos)  # (S, 1, T, L)
    out = F.scaled_dot_product_attention(
        q,
        keys[:, None].to(q.dtype),
        values[:, None].to(q.dtype),
        attn_mask=allowed,
        scale=scaling,
        enable_gqa=True,
    )
    return out.reshape(bsz, h_q, t, dim)


def segmentwise_chunk_attention(
    query: torch.Tensor, layer, query_pos: torch.Tensor, scaling: float, weights_per_call: int
) -> torch.Tensor:
    """A prefill chunk's T queries per row over ``layer`` (what it held, then the chunk appended as the
    last T entries of every segment), one SDPA call per segment and block of queries.

    Each segment is read in place (its live entries are contiguous in the flat buffer), so no padded
    copy of the store is made and no segment pays for a longer one's entries (per-head budgets make
    segments ragged). A block of queries reads the held entries and the chunk's keys up to its own
    last query (later ones follow every query of the block), so the chunk's causal upper half is
    mostly skipped; the mask is the position rule (key j visible to query q iff ``0 <= pos_j <= pos_q``).
    Blocks are at most ``CHUNK_QUERY_BLOCK`` queries, fewer where one call's attention weights
    (G x block x entries) would exceed ``weights_per_call`` (a kernel that materialises them).

    query: (B, H_q, T, D); query_pos: (B, T). Returns (B, H_q, T, D).
    """
    bsz, h_q, t, dim = query.shape
    groups = h_q // layer.num_heads
    q = query.reshape(layer.num_segments, groups, t, dim)
    out = torch.empty_like(q)
    for segment, (begin, count) in enumerate(zip(layer.start.tolist(), layer.length.tolist())):
        held = count - t
        qpos = query_pos[segment // layer.num_heads]
        step = min(CHUNK_QUERY_BLOCK, max(16, weights_per_call // max(groups * count, 1)))
        for first in range(0, t, step):
            last = min(first + step, t)
            end = begin + held + last  # the held entries and the chunk's keys up to this block's last query
            keys = layer.keys[begin:end][None, None].to(q.dtype)
            values = layer.values[begin:end][None, None].to(q.dtype)
            key_pos = layer.positions[begin:end]
            allowed = (key_pos[None, :] >= 0) & (key_pos[None, :] <= qpos[first:last, None])  # (block, keys)
            out[segment, :, first:last] = F.scaled_dot_product_attention(
                q[segment, None, :, first:last], keys, values, attn_mask=allowed, scale=scaling, enable_gqa=True
            )[0]
    return out.reshape(bsz, h_q, t, dim)


def packed_segments(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The store's live, non-padding entries as flash-attn varlen sequences.

    Returns keys, values (N, 1, D), ``cu_seqlens`` (S + 1,) int32 and the longest sequence; a
    view of the store's buffers when its segments are adjacent and hold no padding entries,
    otherwise one gather.
    """
    length = layer.length
    cu = torch.zeros(length.numel() + 1, dtype=torch.long, device=length.device)
    torch.cumsum(length, 0, out=cu[1:])
    total = int(cu[-1])
    adjacent = bool((layer.start == cu[:-1]).all())
    if adjacent and not bool((layer.positions[:total] < 0).any()):
        keys, values = layer.keys[:total], layer.values[:total]
        lengths = length
    else:
        index = layer.live_index()  # live entries, segment by segment
        real = layer.positions[index] >= 0
        index = index[real]
        segment = torch.repeat_interleave(torch.arange(length.numel(), device=length.device), length)[real]
        lengths = torch.bincount(segment, minlength=length.numel())
        torch.cumsum(lengths, 0, out=cu[1:])
        keys, values = layer.keys[index], layer.values[index]
    max_len = int(lengths.max()) if lengths.numel() else 0
    return keys[:, None], values[:, None], cu.to(torch.int32), max_len


def flash_varlen_attention(query: torch.Tensor, layer, scaling: float) -> torch.Tensor:
    """Attention of T new queries per row over ``layer`` with flash-attn's ``flash_attn_varlen_func``.

    query: (B, H_q, T, D); the chunk's keys must already be appended (they are the last T entries
    of each segment). Returns (B, H_q, T, D).
    """
    fn = flash_varlen_function()
    if fn is None:
        raise RuntimeError("the flash varlen kernel needs the flash-attn package (pip install flash-attn)")
    bsz, h_q, t, dim = query.shape
    segments = layer.num_segments
    groups = h_q // (segments // bsz)
    keys, values, cu_k, max_k = packed_segments(layer)
    # (B, H_kv, G, T, D) -> one sequence of T tokens x G heads per segment
    q = query.reshape(segments, groups, t, dim).transpose(1, 2).reshape(segments * t, groups, dim)
    cu_q = torch.arange(0, (segments + 1) * t, t, dtype=torch.int32, device=query.device)
    out = fn(
        q.contiguous(),
        keys.to(query.dtype),
        values.to(query.dtype),
        cu_q,
        cu_k,
        t,
        max_k,
        softmax_scale=scaling,
        causal=True,
    )
    return out.reshape(segments, t, groups, dim).transpose(1, 2).reshape(bsz, h_q, t, dim)
