"""``slice_attention`` (a slice of a layer-by-layer prefill) against a naive reference: per row, query
and head, a softmax over the keys it may see, written out with loops (random tensors, batch 2, with
and without left padding, grouped-query heads; also in bfloat16 against the float32 reference)."""

import pytest
import torch

from pipeline.kv.attention.dense import dense_prefill_attention, slice_attention
from tests.tiny import DEVICE


def naive(query, key, value, key_pos, start, scaling):
    """query (B, H_q, s, D) at columns [start, start + s); key/value (B, H_kv, start + s, D)."""
    bsz, h_q, s, _ = query.shape
    group = h_q // key.shape[1]
    out = torch.zeros_like(query)
    for b in range(bsz):
        for i in range(s):
            col = start + i
            visible = [j for j in range(col + 1) if key_pos[b, j] >= 0 or j == col]
            for h in range(h_q):
                k, v = key[b, h // group, visible], value[b, h // group, visible]
                weights = torch.softmax((k @ query[b, h, i]) * scaling, dim=0)
                out[b, h, i] = weights @ v
    return out


def _inputs(length, padding, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 6, length, 8, generator=g).to(DEVICE)
    key = torch.randn(2, 2, length, 8, generator=g).to(DEVICE)
    value = torch.randn(2, 2, length, 8, generator=g).to(DEVICE)
    pos = torch.arange(length).repeat(2, 1)
    pos[1, :padding] = -1
    pos[1, padding:] -= padding
    return query, key, value, pos.to(DEVICE)


@pytest.mark.parametrize("padding", [0, 7])  # unpadded slices on CPU: two fused calls merged, no mask
@pytest.mark.parametrize("start,end", [(0, 5), (5, 12), (12, 13), (13, 21)])
def test_each_slice_matches_the_naive_reference(start, end, padding):
    query, key, value, pos = _inputs(21, padding=padding)
    got = slice_attention(query[:, :, start:end], key[:, :, :end], value[:, :, :end], pos[:, :end], start, 0.3)
    want = naive(query[:, :, start:end], key[:, :, :end], value[:, :, :end], pos[:, :end], start, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding", [0, 9])
def test_slices_together_are_the_one_pass_causal_attention(padding):
    query, key, value, pos = _inputs(30, padding=padding, seed=1)
    whole = dense_prefill_attention(query, key, value, pos, 0.25)
    cuts = [0, 4, 11, 12, 30]
    pieces = [
        slice_attention(query[:, :, a:b], key[:, :, :b], value[:, :, :b], pos[:, :b], a, 0.25)
        for a, b in zip(cuts, cuts[1:])
    ]
    torch.testing.assert_close(torch.cat(pieces, dim=2), whole, rtol=1e-5, atol=1e-5)


def test_bfloat16_slices_stay_close_to_the_float32_reference():
    query, key, value, pos = _inputs(24, padding=0, seed=2)
    query, key, value = query.bfloat16(), key.bfloat16(), value.bfloat16()
    got = slice_attention(query[:, :, 10:], key, value, pos, 10, 0.3)
    assert got.dtype == torch.bfloat16
    want = naive(query[:, :, 10:].float(), key.float(), value.float(), pos, 10, 0.3)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _three_rows(length, seed):
    """Batch 3: unpadded, left-padded by 7, and padding only (a row with nothing real)."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(3, 6, length, 8, generator=g).to(DEVICE)
    key = torch.randn(3, 2, length, 8, generator=g).to(DEVICE)
    value = torch.randn(3, 2, length, 8, generator=g).to(DEVICE)
    pos = torch.arange(length).repeat(3, 1)
    pos[1, :7] = -1
    pos[1, 7:] -= 7
    pos[2] = -1
    return query, key, value, pos.to(DEVICE)


@pytest.mark.parametrize("start,end", [(0, 5), (0, 19), (5, 12), (12, 19)])
def test_left_padded_rows_one_by_one_match_the_naive_reference(start, end):
    query, key, value, pos = _three_rows(19, seed=3)
    got = slice_attention(query[:, :, start:end], key[:, :, :end], value[:, :, :end], pos[:, :end], start, 0.3)
    want = naive(query[:, :, start:end], key[:, :, :end], value[:, :, :end], pos[:, :end], start, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("start", [0, 6])
def test_padding_that_is_not_on_the_left_is_masked_like_the_naive_reference(start):
    """A padding column after real ones (not a left-padded row) takes the masked path."""
    query, key, value, pos = _three_rows(15, seed=4)
    pos[0, 3] = -1
    got = slice_attention(query[:, :, start:], key, value, pos, start, 0.3)
    want = naive(query[:, :, start:], key, value, pos, start, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
