"""Attention math over a prefill and over the variable-length cache: dense causal attention of a
prefill chunk (row by row past left padding), a layer-by-layer prefill's slice over the layer's K/V so
far, the grouped decode step over a uniform cache, and the fp32 reference over a padded view (with its
probabilities, for the decode-time cap). Called by the prefill strategies and the cache; the fused
variable-length kernels are :mod:`.varlen_kernels`, the functions registered with transformers
:mod:`.registered`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_QUERY_CHUNK = 4096  # prefill queries per masked-SDPA call when rows are padded


def dense_prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pos: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal attention of a left-padded prefill chunk.

    query: (B, H_q, n, D); key/value: (B, H_kv, n, D); key_pos: (B, n) (-1 = padding).
    Padding queries attend to themselves only (finite, ignored). A left-padded batch runs row by row
    over each row's real columns (:func:`_row_by_row`); other padding patterns one masked SDPA per
    block of queries. Returns (B, H_q, n, D).
    """
    n = query.shape[2]
    if bool((key_pos >= 0).all()):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    firsts = _left_padding(key_pos)
    if firsts is not None:
        return _row_by_row(query, key, value, firsts, 0, scaling)
    out = torch.empty_like(query)
    for begin in range(0, n, _QUERY_CHUNK):
        mask = _visible(key_pos, begin, min(n, begin + _QUERY_CHUNK))
        out[:, :, begin : begin + _QUERY_CHUNK] = F.scaled_dot_product_attention(
            query[:, :, begin : begin + _QUERY_CHUNK],
            key,
            value,
            attn_mask=mask[:, None],
            scale=scaling,
            enable_gqa=True,
        )
    return out


def _left_padding(key_pos: torch.Tensor) -> list[int] | None:
    """Each row's first real column when every row of key_pos (B, K) is left-padded (padding, then
    only real columns); None otherwise."""
    real = key_pos >= 0
    firsts = real.shape[1] - real.sum(dim=1)
    columns = torch.arange(real.shape[1], device=real.device)
    if not bool((real == (columns[None, :] >= firsts[:, None])).all()):
        return None
    return firsts.tolist()


def _row_by_row(query, key, value, firsts: list[int], start: int, scaling: float) -> torch.Tensor:
    """:func:`slice_attention` of a left-padded batch one row at a time over the row's real columns
    only, so each row runs the fast unmasked kernels (a masked SDPA over the padded batch cannot skip
    blocks: 2.4x the time of the rows one by one at 4 rows of 4K tokens on CPU). A padding query sees
    itself only, so its output is its own column's value (its KV head's). query: (B, H_q, s, D) at
    columns [start, start + s); key/value: (B, H_kv, start + s, D); firsts: each row's first real
    column. Returns (B, H_q, s, D)."""
    end = key.shape[2]
    group = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for row, first in enumerate(firsts):
        real_from = max(first, start)  # the row's first real query column
        if real_from > start:
            out[row, :, : real_from - start] = value[row, :, start:real_from].repeat_interleave(group, dim=0)
        if real_from < end:
            real_pos = torch.zeros(1, end - first, dtype=torch.long, device=key.device)  # all real
            out[row : row + 1, :, real_from - start :] = slice_attention(
                query[row : row + 1, :, real_from - start :],
                key[row : row + 1, :, first:],
                value[row : row + 1, :, first:],
                real_pos,
                real_from - first,
                scaling,
            )
    return out


def _visible(key_pos: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """(B, end - begin, K) bool: which of the K key columns (key_pos (B, K), -1 = padding) the query
    columns [begin, end) of a left-padded prefill see: earlier or equal real columns, and itself
    (so that a padding query's output stays finite)."""
    k_idx = torch.arange(key_pos.shape[1], device=key_pos.device)
    q_idx = k_idx[begin:end]
    causal = (k_idx[None, :] <= q_idx[:, None])[None] & (key_pos >= 0)[:, None, :]
    return causal | (k_idx[None, :] == q_idx[:, None])[None]


def slice_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pos: torch.Tensor, start: int, scaling: float
) -> torch.Tensor:
    """Causal attention of one slice of a left-padded prefill over the slice and everything before it.

    query: (B, H_q, s, D), the queries of columns [start, start + s); key/value: (B, H_kv, start + s, D),
    columns [0, start + s); key_pos: (B, start + s) (-1 = padding). Column j is visible to query column
    i iff it is not padding and j <= i (a padding query sees itself only), as in
    :func:`dense_prefill_attention`, which the first slice is. An unpadded slice on CPU: two fused calls
    merged (:func:`_earlier_then_own_columns`). A left-padded batch: row by row over each row's real
    columns (:func:`_row_by_row`). Otherwise one SDPA per KV head, so only that head's keys
    are repeated for its query group, with one additive mask for all heads (a boolean one would be
    converted by every call). Returns (B, H_q, s, D).
    """
    if start == 0:
        return dense_prefill_attention(query, key, value, key_pos, scaling)
    if query.device.type == "cpu" and bool((key_pos >= 0).all()):
        out = _earlier_then_own_columns(query, key, value, start, scaling)
        if out is not None:
            return out
    firsts = _left_padding(key_pos)
    if firsts is not None and any(firsts):  # padded (all zeros: nothing to skip)
        return _row_by_row(query, key, value, firsts, start, scaling)
    h_q, h_kv = query.shape[1], key.shape[1]
    unseen = ~_visible(key_pos, start, key.shape[2])  # (B, s, end)
    mask = torch.zeros(unseen.shape, dtype=query.dtype, device=query.device).masked_fill_(unseen, float("-inf"))
    del unseen
    group = h_q // h_kv
    out = torch.empty_like(query)
    for head in range(h_kv):
        heads = slice(head * group, (head + 1) * group)
        out[:, heads] = F.scaled_dot_product_attention(
            query[:, heads],
            key[:, head : head + 1],
            value[:, head : head + 1],
            attn_mask=mask[:, None],
            scale=scaling,
            enable_gqa=True,
        )
    return out


def _earlier_then_own_columns(query, key, value, start: int, scaling: float) -> torch.Tensor | None:
    """:func:`slice_attention` of an unpadded slice on CPU without a mask: the fused CPU flash kernel over
    the earlier columns (all visible) and over the slice's own (causal), merged by the two log-sum-exps
    the kernel returns (masked SDPA cannot skip blocks and adds the mask: 1.3x the time at 4K tokens).
    The kernel is torch's own (``aten::_scaled_dot_product_flash_attention_for_cpu``, what SDPA calls
    on CPU); None when this torch lacks it or refuses the inputs (the caller then masks)."""
    if _FLASH_CPU is None:
        return None
    try:
        out_a, lse_a = _FLASH_CPU(query, key[:, :, :start], value[:, :, :start], 0.0, False, scale=scaling)
        out_b, lse_b = _FLASH_CPU(query, key[:, :, start:], value[:, :, start:], 0.0, True, scale=scaling)
    except (RuntimeError, TypeError):
        return None
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = (lse_a - top).exp_(), (lse_b - top).exp_()
    total = weight_a + weight_b
    merged = out_a.float().mul_((weight_a / total)[..., None]).add_(out_b.float() * (weight_b / total)[..., None])
    return merged.to(query.dtype)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def grouped_decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One new token per row over a dense cache in which every entry precedes it (no mask).

    query: (B, H_q, 1, D); keys/values: (B, H_kv, L, D), any strides along L (a store view).
    The G query heads of a KV group are one (G, D) matrix against that group's keys: two batched
    matmuls with an fp32 softmax between, instead of SDPA's per-query-head kernel (faster on CPU:
    ``benchmarks/decode_paths.py`` measures whole decode steps, docs/BENCHMARKS.md has the figures;
    and on CUDA: ``benchmarks/gpu_decode_ab.py``, docs/results/gpu). The logits are rounded to the
    cache's dtype before the fp32 softmax, as transformers' eager attention does.
    Returns (B, H_q, 1, D).
    """
    bsz, h_q, _, dim = query.shape
    h_kv = keys.shape[1]
    q = query.reshape(bsz, h_kv, h_q // h_kv, dim).to(keys.dtype)
    probs = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scaling).softmax(dim=-1)  # (B, H_kv, G, L)
    out = torch.matmul(probs.to(values.dtype), values)  # (B, H_kv, G, D)
    return out.reshape(bsz, h_q, 1, dim).to(query.dtype)


def varlen_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    scaling: float,
    return_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of new queries over per-(row, KV head) segments.

    query: (B, H_q, T, D); keys/values: (S, L, D) with S = B * H_kv (padded view of the
    variable-length store); key_pos: (S, L) (-1 = no entry); query_pos: (B, T).
    Returns output (B, H_q, T, D) and, if asked, probabilities (B, H_kv, G, T, L) float32.
    """
    bsz, h_q, t, dim = query.shape
    segments, length, _ = keys.shape
    h_kv = segments // bsz
    groups = h_q // h_kv
    q = query.reshape(segments, groups * t, dim)
    logits = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling  # (S, G*T, L)
    qpos = query_pos[:, None, :].expand(bsz, h_kv, t).reshape(segments, 1, t)  # (S, 1, T)
    kpos = key_pos[:, None, None, :]  # (S, 1, 1, L)
    allowed = (kpos >= 0) & (kpos <= qpos[..., None])  # (S, 1, T, L)
    logits = logits.view(segments, groups, t, length).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.to(values.dtype).view(segments, groups * t, length), values)
    out = out.view(bsz, h_q, t, dim)
    return out, (probs.view(bsz, h_kv, groups, t, length) if return_probs else None)
