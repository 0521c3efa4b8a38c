"""The accelerator kernels over the variable-length cache equal the fp32 reference.

``sdpa`` runs here as it would on CUDA (same torch call). ``flash`` cannot run without a GPU and
flash-attn, so its packing (segments as sequences, G query heads per KV head, padding left out,
bottom-right causal alignment) is checked by handing it ``naive_flash_varlen``: a per-sequence
implementation of ``flash_attn_varlen_func``'s documented semantics written here.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.config import GenerationConfig
from pipeline.engine.engine import Engine
from pipeline.engine.types import Request
from pipeline.kv.attention import varlen_kernels
from pipeline.kv.attention.dense import varlen_attention
from pipeline.kv.attention.registered import cache_keyword
from pipeline.kv.attention.varlen_kernels import (
    DENSE_ENV,
    FLAT_MAX_MASKED,
    KERNEL_ENV,
    RAGGED_ENV,
    KernelChoice,
    blocked_attention,
    choose_kernel,
    dense_decode_kernel,
    flash_varlen_attention,
    flat_decode_attention,
    packed_segments,
    ragged_decode_kernel,
    sdpa_varlen_attention,
    segmentwise_chunk_attention,
)
from pipeline.kv.config import CompressionConfig
from pipeline.kv.storage import cache as cache_module
from pipeline.kv.storage.store import BLOCK, VarLenLayer
from tests.tiny import tiny_loaded


def naive_flash_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False
):
    """flash_attn_varlen_func's contract: q (Nq, H, D), k/v (Nk, H_k, D); sequence i is
    q[cu_q[i]:cu_q[i+1]] against k[cu_k[i]:cu_k[i+1]]; causal masks are aligned to the bottom
    right (query j sees key m iff m <= len_k - len_q + j); a query seeing no key outputs 0."""
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    out = torch.zeros_like(q)
    heads, heads_k = q.shape[1], k.shape[1]
    for i in range(cu_seqlens_q.numel() - 1):
        qa, qb = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ka, kb = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        assert qb - qa <= max_seqlen_q and kb - ka <= max_seqlen_k
        for h in range(heads):
            kh = h // (heads // heads_k)
            for j in range(qb - qa):
                limit = (kb - ka) - (qb - qa) + j if causal else kb - ka - 1
                if limit < 0:
                    continue
                keys, values = k[ka : ka + limit + 1, kh].float(), v[ka : ka + limit + 1, kh].float()
                weights = torch.softmax((keys @ q[qa + j, h].float()) * softmax_scale, dim=0)
                out[qa + j, h] = (weights @ values).to(q.dtype)
    return out


def _layer_and_chunk(
    bsz=2, h_kv=2, groups=2, n=12, t=3, dim=8, pad=(0, 2), seed=0, append=True, device="cpu", dtype=torch.float32
):
    """A compressed layer (random ragged keep masks, left-padded prefill) plus a chunk of T new
    tokens appended (row b's first pad[b] tokens are padding). Returns layer, query, query_pos."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    key, value = randn(bsz, h_kv, n, dim), randn(bsz, h_kv, n, dim)
    positions = torch.arange(n).repeat(bsz, 1)
    positions[1, :3] = -1  # row 1's context is left padded
    positions[1, 3:] -= 3
    keep = torch.rand(bsz, h_kv, n, generator=g) < 0.5
    keep[..., -2:] = True  # a window
    layer = VarLenLayer.from_dense(key, value, positions.to(device), keep.to(device))
    ctx_len = (positions.max(-1).values + 1)[:, None]
    chunk_pos = ctx_len + torch.arange(t)[None]
    if not append:
        t = 1
        chunk_pos = ctx_len
    else:
        for b, p in enumerate(pad):
            chunk_pos[b, :p] = -1
            chunk_pos[b, p:] = ctx_len[b, 0] + torch.arange(t - p)
        layer.append(randn(bsz, h_kv, t, dim), randn(bsz, h_kv, t, dim), chunk_pos.to(device))
    query = randn(bsz, h_kv * groups, t, dim)
    real = chunk_pos >= 0
    query_pos = torch.where(real, chunk_pos, torch.zeros_like(chunk_pos))
    return layer, query, query_pos.to(device), real.to(device)


def _reference(layer, query, query_pos, scaling):
    keys, values, key_pos = layer.padded_view()
    return varlen_attention(query.float(), keys.float(), values.float(), key_pos, query_pos, scaling)[0]


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("append", [True, False])
def test_flash_packing_equals_the_reference(groups, append, monkeypatch):
    layer, query, query_pos, real = _layer_and_chunk(groups=groups, append=append)
    expected = _reference(layer, query, query_pos, 0.3)
    monkeypatch.setattr(varlen_kernels, "flash_varlen_function", lambda: naive_flash_varlen)
    got = flash_varlen_attention(query, layer, 0.3)
    mask = real[:, None, :, None].expand_as(expected)  # padding queries' outputs are ignored
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)


def test_packed_segments_is_a_view_right_after_compression_and_a_gather_after_appends():
    layer, *_ = _layer_and_chunk(append=False)
    keys, values, cu, max_len = packed_segments(layer)
    assert keys.data_ptr() == layer.keys.data_ptr() and keys.shape == (int(layer.length.sum()), 1, 8)
    assert cu.tolist() == [0, *torch.cumsum(layer.length, 0).tolist()] and max_len == layer.max_length
    layer, *_ = _layer_and_chunk(append=True, pad=(0, 2))
    keys, _, cu, _ = packed_segments(layer)
    assert keys.data_ptr() != layer.keys.data_ptr()
    padding_entries = 2 * layer.num_heads  # row 1's two padding tokens, in each of its heads
    assert int(cu[-1]) == int(layer.length.sum()) - padding_entries == keys.shape[0]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_sdpa_equals_the_reference(dtype, tol):
    layer, query, query_pos, real = _layer_and_chunk(groups=2)
    expected = _reference(layer, query, query_pos, 0.3)
    keys, values, key_pos = layer.padded_view()
    got = sdpa_varlen_attention(query.to(dtype), keys.to(dtype), values.to(dtype), key_pos, query_pos, 0.3)
    assert got.dtype == dtype
    mask = real[:, None, :, None].expand_as(expected)
    torch.testing.assert_close(got.float()[mask], expected[mask], atol=tol, rtol=tol)


@pytest.mark.parametrize("groups", [1, 3])
def test_blocked_decode_equals_the_reference_in_place(groups):
    """Ragged segments grown into blocks, padding entries of a left-padded question chunk inside
    them, a question rolled back (stale entries past the length), then one decode token."""
    layer, *_ = _layer_and_chunk(groups=groups, append=False)
    assert blocked_attention(torch.zeros(2, 2 * groups, 1, 8), layer, None, 0.3) is None  # exact-sized
    layer.reserve(8)
    assert layer.block_table() is not None and bool((layer.capacity % BLOCK == 0).all())
    g = torch.Generator().manual_seed(5)
    start = layer.positions.view(2, -1).max(-1).values[:, None] + 1
    chunk = start + torch.arange(3)[None]
    chunk[1, :2] = -1  # row 1's question is shorter: two padding tokens
    layer.append(torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g), chunk)
    snapshot = layer.length.clone()
    next_pos = chunk.max(-1, keepdim=True).values + 1
    later = next_pos + torch.arange(3)[None]
    layer.append(torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g), later)
    layer.truncate(snapshot)  # the entries just appended are forgotten but still in the buffer
    layer.append(torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g), next_pos)
    query = torch.randn(2, 2 * groups, 1, 8, generator=g)
    keys_before = layer.keys.data_ptr()
    got = blocked_attention(query, layer, next_pos, 0.3)
    torch.testing.assert_close(got, _reference(layer, query, next_pos, 0.3), atol=1e-5, rtol=1e-5)
    assert layer.keys.data_ptr() == keys_before


def test_blocked_slices_bound_every_temporary(monkeypatch):
    """A slice of queries holds at most ``max_elements`` elements of temporaries: per block and query
    head the gathered query and the weighted values (D each), the logits and probabilities (W each)."""
    layer, query, query_pos, _ = _layer_and_chunk(groups=3, append=True, pad=(0, 2))
    blocks, width = layer.block_table()[1].shape
    per_query = blocks * (query.shape[1] // layer.num_heads) * (2 * query.shape[3] + 2 * width)
    sizes, real_slice = [], varlen_kernels._blocked_slice

    def recorded(q, *args, **kwargs):
        sizes.append(q.shape[2])
        return real_slice(q, *args, **kwargs)

    monkeypatch.setattr(varlen_kernels, "_blocked_slice", recorded)
    blocked_attention(query, layer, query_pos, 0.3, max_elements=2 * per_query + 1)
    assert query.shape[2] > 2 and max(sizes) == 2 and sum(sizes) == query.shape[2]


@pytest.mark.parametrize("max_elements", [1 << 20, 1])
@pytest.mark.parametrize("groups", [1, 3])
def test_blocked_chunk_equals_the_reference(groups, max_elements):
    """A left-padded chunk of several tokens (causal among themselves) over ragged segments; with
    ``max_elements`` 1 every query goes alone."""
    layer, query, query_pos, real = _layer_and_chunk(groups=groups, append=True, pad=(0, 2))
    assert layer.block_table() is not None  # the append grew the layer into blocks
    got = blocked_attention(query, layer, query_pos, 0.3, max_elements=max_elements)
    expected = _reference(layer, query, query_pos, 0.3)
    mask = real[:, None, :, None].expand_as(expected)
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("block, weights", [(256, 1 << 24), (16, 1 << 24), (256, 1)])
def test_segmentwise_chunk_attention_equals_the_reference(groups, block, weights, monkeypatch):
    """A left-padded chunk of 40 tokens over ragged segments, read segment by segment: in one block,
    in query blocks of 16 (each reading the chunk's keys only up to its last query), and in the
    smallest blocks the weight bound allows."""
    monkeypatch.setattr(varlen_kernels, "CHUNK_QUERY_BLOCK", block)
    layer, query, query_pos, real = _layer_and_chunk(groups=groups, append=True, t=40, pad=(0, 21))
    got = segmentwise_chunk_attention(query, layer, query_pos, 0.3, weights)
    expected = _reference(layer, query, query_pos, 0.3)
    mask = real[:, None, :, None].expand_as(expected)
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 3])
def test_flat_decode_equals_the_reference_over_many_steps(groups):
    """One row, ragged segments: a question chunk, decode steps (the cached head mask updated in
    place by every append), a rollback, more steps; the flat kernel equals the reference each time
    and its mask equals one built afresh from the layer."""
    g = torch.Generator().manual_seed(7)
    h_kv, n, dim = 3, 40, 8
    keep = torch.rand(1, h_kv, n, generator=g) < torch.tensor([0.2, 0.5, 0.9])[None, :, None]
    key, value = torch.randn(1, h_kv, n, dim, generator=g), torch.randn(1, h_kv, n, dim, generator=g)
    layer = VarLenLayer.from_dense(key, value, torch.arange(n)[None], keep)
    query = torch.randn(1, h_kv * groups, 1, dim, generator=g)
    assert flat_decode_attention(query, layer, 0.3) is None  # exact-sized: not block aligned

    def append(positions):
        t = positions.shape[1]
        layer.append(torch.randn(1, h_kv, t, dim, generator=g), torch.randn(1, h_kv, t, dim, generator=g), positions)

    def step(pos):
        append(torch.tensor([[pos]]))
        q = torch.randn(1, h_kv * groups, 1, dim, generator=g)
        got = flat_decode_attention(q, layer, 0.3)
        torch.testing.assert_close(got, _reference(layer, q, torch.tensor([[pos]]), 0.3), atol=1e-5, rtol=1e-5)
        assert torch.equal(layer.head_bias(), layer.clone().head_bias())

    append(torch.arange(n, n + 5)[None])  # the question: grows the layer into blocks
    snapshot, buffer = layer.length.clone(), layer.keys.data_ptr()
    for pos in range(n + 5, n + 5 + 2 * BLOCK):  # crosses a block boundary and a re-layout
        step(pos)
    layer.truncate(snapshot)
    for pos in range(n + 5, n + 8):
        step(pos)
    assert layer.head_bias().shape == (h_kv, layer.keys.shape[0])
    assert layer.nbytes() > layer.clone().nbytes()  # the cached mask is counted while it exists
    assert buffer != layer.keys.data_ptr()  # the decode steps outgrew the first reservation


def test_ragged_decode_kernel_choice():
    layer, *_ = _layer_and_chunk()  # two rows
    one_row = VarLenLayer.from_dense(
        torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.arange(4)[None], torch.ones(1, 2, 4, dtype=torch.bool)
    )
    assert ragged_decode_kernel(torch.zeros(1, 4, 1, 8), one_row) == "flat"
    assert ragged_decode_kernel(torch.zeros(1, 4, 3, 8), one_row) == "blocked"  # a chunk: causal inside
    assert ragged_decode_kernel(torch.zeros(2, 4, 1, 8), layer) == "blocked"  # rows: the waste grows
    long_row = VarLenLayer.from_dense(
        torch.zeros(1, 2, FLAT_MAX_MASKED, 8),
        torch.zeros(1, 2, FLAT_MAX_MASKED, 8),
        torch.arange(FLAT_MAX_MASKED)[None],
        torch.rand(1, 2, FLAT_MAX_MASKED) < 0.6,
    )
    assert ragged_decode_kernel(torch.zeros(1, 4, 1, 8), long_row) == "blocked"  # H x slots > the limit
    assert ragged_decode_kernel(torch.zeros(1, 4, 1, 8), one_row, "blocked") == "blocked"
    assert ragged_decode_kernel(torch.zeros(2, 4, 1, 8), layer, "flat") == "blocked"  # flat needs one row
    assert ragged_decode_kernel(torch.zeros(1, 4, 1, 8), long_row, "flat") == "flat"


def test_kernel_choice():
    q = torch.zeros(1, 2, 1, 4)
    assert choose_kernel(q, need_probs=False) == "blocked"  # CPU default
    assert choose_kernel(q, need_probs=False, forced="sdpa") == "sdpa"
    assert choose_kernel(q, need_probs=True, forced="sdpa") == "reference"  # the decode cap needs probabilities


def test_kernel_choice_on_cuda_without_flash_attn(monkeypatch):
    """CUDA without flash-attn: decode steps read the ragged store in place (``blocked``), longer
    chunks take SDPA over the padded view; with flash-attn, flash for both (fp16/bf16)."""
    from types import SimpleNamespace

    monkeypatch.setattr(varlen_kernels, "flash_varlen_function", lambda: None)

    def cuda_query(tokens: int, dtype=torch.bfloat16):
        return SimpleNamespace(is_cuda=True, dtype=dtype, shape=(2, 4, tokens, 8))

    assert choose_kernel(cuda_query(1), need_probs=False) == "blocked"
    assert dense_decode_kernel(choose_kernel(cuda_query(1), need_probs=False)) == "grouped"  # a uniform cache
    assert choose_kernel(cuda_query(7), need_probs=False) == "sdpa"
    assert choose_kernel(cuda_query(1), need_probs=True) == "reference"
    monkeypatch.setattr(varlen_kernels, "flash_varlen_function", lambda: naive_flash_varlen)
    assert choose_kernel(cuda_query(1), need_probs=False) == "flash"
    assert choose_kernel(cuda_query(1, torch.float32), need_probs=False) == "blocked"


def test_dense_decode_kernel_choice():
    q = torch.zeros(1, 2, 1, 4)
    assert dense_decode_kernel(choose_kernel(q, need_probs=False)) == "grouped"  # CPU default
    assert dense_decode_kernel(choose_kernel(q, False, "sdpa")) == "sdpa"  # forced SDPA: the dense view too
    assert dense_decode_kernel("sdpa", forced="grouped") == "grouped"


def test_forced_kernels_are_read_once_when_a_cache_is_made(monkeypatch):
    """The environment forces kernels for the caches made after it is set; a cache keeps its choice."""
    from pipeline.kv.compress import Compressor
    from pipeline.kv.config import CompressionConfig
    from pipeline.kv.storage.cache import VarLenCache

    for name in (KERNEL_ENV, DENSE_ENV, RAGGED_ENV):
        monkeypatch.delenv(name, raising=False)
    assert KernelChoice.from_environment() == KernelChoice()
    monkeypatch.setenv(KERNEL_ENV, " SDPA ")
    monkeypatch.setenv(RAGGED_ENV, "blocked")
    cache = VarLenCache(2, Compressor(CompressionConfig()))
    assert cache.kernels == KernelChoice(varlen="sdpa", ragged="blocked")
    monkeypatch.setenv(KERNEL_ENV, "reference")
    assert cache.kernels.varlen == "sdpa"  # not read again per call
    bad_values = ((KERNEL_ENV, "triton", "varlen"), (DENSE_ENV, "flash", "dense"), (RAGGED_ENV, "dense", "ragged"))
    for name, bad, value in bad_values:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}'"):
            KernelChoice.from_environment()
        with pytest.raises(ValueError, match=f"{name}='{bad}'"):
            KernelChoice(**{value: bad})
        monkeypatch.delenv(name)


def test_flash_without_flash_attn_says_what_is_missing(monkeypatch):
    layer, query, *_ = _layer_and_chunk()
    monkeypatch.setattr(varlen_kernels, "flash_varlen_function", lambda: None)
    with pytest.raises(RuntimeError, match="flash-attn"):
        flash_varlen_attention(query, layer, 0.3)


@pytest.mark.parametrize("kernel", ["sdpa", "flash", "blocked"])
def test_engine_batches_give_the_same_answers_with_each_kernel(kernel, monkeypatch):
    """Batched, left-padded rows with ragged AdaKV budgets, several questions per context."""
    requests = [
        Request("a", "The quick brown fox jumps over the lazy dog. " * 5, ["Who jumps?", "What dog?"]),
        Request("b", "Pack my box with five dozen liquor jugs. " * 2, ["What is packed in the box?"]),
    ]
    config = CompressionConfig(method="criticalkv-adakv-snapkv", cache_size=0.4, window=4, kernel=3)

    def run():
        engine = Engine(tiny_loaded("mistral"), config, GenerationConfig(max_new_tokens=8, batch_size=2))
        return [(a.prediction, a.kv_entries_kept, a.error) for a in engine.generate(requests)]

    monkeypatch.setenv(KERNEL_ENV, "reference")
    expected = run()
    monkeypatch.setenv(KERNEL_ENV, kernel)
    monkeypatch.setattr(varlen_kernels, "flash_varlen_function", lambda: naive_flash_varlen)
    assert run() == expected and all(error is None for *_, error in expected)


def test_single_row_ragged_decode_answers_alike_with_flat_blocked_and_reference(monkeypatch):
    """One document at a time (the CPU default), ragged AdaKV budgets, two questions: the flat
    decode kernel (inside the blocked path, CPU's default, forced here so that the test means the
    same on CUDA) runs and answers exactly as the blocked kernel and the fp32 reference do."""
    requests = [Request("a", "The quick brown fox jumps over the lazy dog. " * 6, ["Who jumps?", "What dog?"])]
    config = CompressionConfig(method="criticalkv-adakv-snapkv", cache_size=0.4, window=4, kernel=3)
    calls = []

    def counted(*args):
        calls.append(1)
        return flat_decode_attention(*args)

    monkeypatch.setattr(cache_module, "flat_decode_attention", counted)

    def run():
        calls.clear()
        engine = Engine(tiny_loaded("mistral"), config, GenerationConfig(max_new_tokens=8))
        return [(a.prediction, a.kv_entries_kept, a.error) for a in engine.generate(requests)], len(calls)

    monkeypatch.setenv(KERNEL_ENV, "blocked")
    flat, flat_calls = run()
    assert flat_calls > 0 and all(error is None for *_, error in flat)
    monkeypatch.setenv(RAGGED_ENV, "blocked")
    assert run() == (flat, 0)
    monkeypatch.setenv(KERNEL_ENV, "reference")
    assert run() == (flat, 0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or varlen_kernels.flash_varlen_function() is None,
    reason="needs CUDA and flash-attn (benchmarks/gpu_check.sh runs it on a GPU machine)",
)
@pytest.mark.parametrize("append", [True, False])
def test_real_flash_attn_equals_the_reference_on_cuda(append):
    layer, query, query_pos, real = _layer_and_chunk(
        groups=4, dim=64, n=300, append=append, device="cuda", dtype=torch.bfloat16
    )
    expected = _reference(layer, query, query_pos, 0.125)
    got = flash_varlen_attention(query, layer, 0.125)
    mask = real[:, None, :, None].expand_as(expected)
    torch.testing.assert_close(got.float()[mask], expected[mask], atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sdpa_on_cuda_in_bf16_equals_the_reference():
    layer, query, query_pos, real = _layer_and_chunk(groups=4, dim=64, n=300, device="cuda", dtype=torch.bfloat16)
    expected = _reference(layer, query, query_pos, 0.125)
    keys, values, key_pos = layer.padded_view()
    got = sdpa_varlen_attention(query, keys, values, key_pos, query_pos, 0.125)
    mask = real[:, None, :, None].expand_as(expected)
    torch.testing.assert_close(got.float()[mask], expected[mask], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("groups", [1, 3])
def test_grouped_decode_equals_a_per_head_softmax_over_a_strided_store_view(groups):
    """The dense one-token path (uniform caches on CPU) against an explicit per-query-head
    softmax, on keys/values that are a view with spare capacity (as the store hands them out)."""
    from pipeline.kv.attention.dense import grouped_decode_attention

    gen = torch.Generator().manual_seed(3)
    bsz, h_kv, length, capacity, dim = 2, 2, 11, 16, 8
    store_k = torch.randn(bsz, h_kv, capacity, dim, generator=gen)
    store_v = torch.randn(bsz, h_kv, capacity, dim, generator=gen)
    keys, values = store_k[:, :, :length], store_v[:, :, :length]
    query = torch.randn(bsz, h_kv * groups, 1, dim, generator=gen)
    out = grouped_decode_attention(query, keys, values, 0.3)
    for b in range(bsz):
        for h in range(h_kv * groups):
            k, v = keys[b, h // groups], values[b, h // groups]
            weights = torch.softmax((k @ query[b, h, 0]) * 0.3, dim=0)
            torch.testing.assert_close(out[b, h, 0], weights @ v, rtol=1e-5, atol=1e-6)


def test_cache_keyword_follows_the_forward_signature():
    """transformers renamed ``past_key_values`` to ``cache`` in 5.24; a model that does not know the
    name would swallow it in ``**kwargs`` and build its own cache, so the name is read off the forward."""

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):
            return cache

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
