"""KVzip's reconstruction passes against naive recomputations.

* random tensors: one pass through ``ReconstructionCache`` gives the attention a full causal
  forward would (context + the pass's own keys) and, for every chunk entry, the max over queries
  and group heads of its weight in a softmax over sinks + chunk + own keys (KVzip+ too), at batch 2
  with left padding;
* tiny model: the scores of ``ContextReconstruction`` equal those recomputed from plain full
  forwards over ``context + pass`` (recording attention), pass by pass, with the prompts rebuilt here.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface

from pipeline.engine.prompts import PromptBuilder
from pipeline.engine.reconstruction import PREVIOUS_TAIL, REPEAT_FIRST, REPEAT_NEXT, ContextReconstruction
from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor, PendingLayer
from pipeline.kv.config import CompressionConfig
from pipeline.kv.prefill.reconstruction import ReconstructionCache
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from tests.tiny import DEVICE, tiny_model, tiny_tokenizer

H_Q, H_KV, D, HIDDEN = 4, 2, 8, 32


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _naive(q, ctx_k, ctx_v, ctx_pos, own_k, own_v, own_pos, sink, start, end, value_weight=None, hidden=None):
    """One row: (output (H_q, T, D), scores {position: score} per KV head) with explicit loops."""
    g = H_Q // H_KV
    out = torch.zeros_like(q)
    scores = [{} for _ in range(H_KV)]
    for h in range(H_Q):
        kh = h // g
        for t in range(q.shape[1]):
            if own_pos[t] < 0:
                continue
            full = [
                (float(q[h, t] @ ctx_k[kh, j]) * D**-0.5, ctx_v[kh, j])
                for j in range(ctx_k.shape[1])
                if ctx_pos[j] >= 0
            ]
            full += [
                (float(q[h, t] @ own_k[kh, u]) * D**-0.5, own_v[kh, u])
                for u in range(q.shape[1])
                if 0 <= own_pos[u] <= own_pos[t]
            ]
            m = max(x for x, _ in full)
            z = sum(math.exp(x - m) for x, _ in full)
            out[h, t] = sum(math.exp(x - m) / z * v for x, v in full)
            keep = [
                (j, float(q[h, t] @ ctx_k[kh, j]) * D**-0.5)
                for j in range(ctx_k.shape[1])
                if ctx_pos[j] >= 0 and (ctx_pos[j] < sink or start <= ctx_pos[j] < end)
            ]
            own = [float(q[h, t] @ own_k[kh, u]) * D**-0.5 for u in range(q.shape[1]) if 0 <= own_pos[u] <= own_pos[t]]
            m = max([x for _, x in keep] + own)
            z = sum(math.exp(x - m) for _, x in keep) + sum(math.exp(x - m) for x in own)
            for j, x in keep:
                p = int(ctx_pos[j])
                if start <= p < end:
                    a = math.exp(x - m) / z
                    if value_weight is not None:
                        a = a * float(value_weight[h, j]) / float(hidden[t])
                    scores[kh][p] = max(scores[kh].get(p, -math.inf), a)
    return out, scores


def _value_weight(v, o_weight):
    """||V_j W_O^h||_2 per query head h: (H_q, n)."""
    g = H_Q // H_KV
    w = torch.zeros(H_Q, v.shape[1])
    for h in range(H_Q):
        w_h = o_weight[:, h * D : (h + 1) * D].T
        w[h] = (v[h // g] @ w_h).norm(dim=-1)
    return w


PASS_CASES = {
    # rows of different lengths (left padding), chunks that leave context entries out of the softmax
    "padded-partial-chunks": ((30, 21), (3, 2), (3, 9), (17, 21), (0, 2)),
    # rows of equal length whose pass covers the whole context after the sinks (the common one-pass case)
    "equal-rows-whole-context": ((30, 30), (3, 3), (3, 3), (30, 30), (0, 0)),
    "one-row-whole-context": ((30,), (4,), (4,), (30,), (0,)),
}


@pytest.mark.parametrize("case", sorted(PASS_CASES))
def test_one_pass_matches_naive_attention_and_scores(case):
    lengths, sinks, starts, ends, own_padding = PASS_CASES[case]
    bsz, n, t = len(lengths), 30, 7
    sinks, starts, ends = torch.tensor(sinks), torch.tensor(starts), torch.tensor(ends)
    ctx_k, ctx_v = _rand(bsz, H_KV, n, D, seed=1), _rand(bsz, H_KV, n, D, seed=2)
    ctx_pos = torch.full((bsz, n), -1)
    for b, length in enumerate(lengths):
        ctx_pos[b, n - length :] = torch.arange(length)
    q, own_k, own_v = _rand(bsz, H_Q, t, D, seed=3) * 2, _rand(bsz, H_KV, t, D, seed=4), _rand(bsz, H_KV, t, D, seed=5)
    own_pos = torch.tensor(
        [[-1] * pad + [length + i for i in range(t - pad)] for length, pad in zip(lengths, own_padding)]
    )
    o_weight = _rand(HIDDEN, H_Q * D, seed=6)
    module = SimpleNamespace(layer_idx=0, o_proj=SimpleNamespace(weight=o_weight))
    for plus in (False, True):
        scores = [torch.zeros(bsz, H_KV, n)]
        layer = PendingLayer(module, ctx_k, ctx_v, ctx_pos, D**-0.5, None)
        cache = ReconstructionCache([layer], starts, ends, sinks, scores, kvzip_plus=plus)
        cache.begin_chunk(own_pos)
        hidden = torch.rand(bsz, t, generator=torch.Generator().manual_seed(7)) + 0.5
        cache.hidden_norms[0] = hidden
        out = cache.attend(module, q, own_k, own_v, D**-0.5)
        for b in range(bsz):
            weight = _value_weight(ctx_v[b], o_weight) if plus else None
            ref_out, ref_scores = _naive(
                q[b],
                ctx_k[b],
                ctx_v[b],
                ctx_pos[b],
                own_k[b],
                own_v[b],
                own_pos[b],
                int(sinks[b]),
                int(starts[b]),
                int(ends[b]),
                weight,
                hidden[b],
            )
            real = own_pos[b] >= 0
            torch.testing.assert_close(out[b][:, real], ref_out[:, real], rtol=1e-4, atol=1e-5)
            pad = n - lengths[b]
            for kh in range(H_KV):
                for p in range(lengths[b]):
                    expected = ref_scores[kh].get(p, 0.0)
                    assert float(scores[0][b, kh, pad + p]) == pytest.approx(expected, rel=1e-4, abs=1e-7)


def _recorded_qk(model, ids):
    """Post-RoPE q and k of every layer for one plain causal forward over ``ids`` (1, T)."""
    found = {}

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        found[module.layer_idx] = (query[0], key[0], scaling)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvzip_test_recording", attention)
    model.set_attn_implementation("kvzip_test_recording")
    with torch.inference_mode():
        model.base_model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=DEVICE)[None])
    return found


def test_passes_on_tiny_model_match_full_forwards():
    model, tok = tiny_model("llama", seed=2), tiny_tokenizer()
    prompts = PromptBuilder(tok)
    g = torch.Generator().manual_seed(8)
    context = torch.randint(0, 256, (40,), generator=g).tolist()
    prefix, chunk = 3, 16
    # ours: prefill into a deferred cache, then the passes
    model.set_attn_implementation(register())
    cache = VarLenCache(2, Compressor(CompressionConfig(method="layer-kvzip", cache_size=0.5, window=4)))
    with torch.inference_mode():
        run_chunk(model, cache, torch.tensor([context], device=DEVICE), torch.arange(40, device=DEVICE)[None])
    held = cache.prefill.awaiting_passes
    ours = ContextReconstruction(model, prompts, 258, DEVICE).scores([context], [prefix], held, chunk, False)
    # naive: each pass as a plain forward over context + pass tokens
    tail = prompts.tail_ids()
    expected = [torch.zeros(H_KV, 40) for _ in range(2)]
    for t, start in enumerate(range(prefix, 40, chunk)):
        end = min(start + chunk, 40)
        instruction = prompts.text_ids(REPEAT_FIRST if t == 0 else REPEAT_NEXT)
        if t:
            instruction += context[start - PREVIOUS_TAIL : start]
        own = instruction + tail + context[start:end]
        qk = _recorded_qk(model, torch.tensor([context + own], device=DEVICE))
        for layer, (q, k, scaling) in qk.items():
            for kh in range(H_KV):
                for h in range(kh * 2, kh * 2 + 2):
                    for i in range(len(own)):
                        qi = 40 + i
                        cols = list(range(prefix)) + list(range(start, end)) + list(range(40, qi + 1))
                        logits = torch.stack([q[h, qi] @ k[kh, c] for c in cols]) * scaling
                        probs = torch.softmax(logits.double(), 0)
                        for c, p in zip(cols, probs):
                            if start <= c < end:
                                expected[layer][kh, c] = max(float(expected[layer][kh, c]), float(p))
    for layer in range(2):
        assert torch.isinf(ours[layer][0, :, :prefix]).all()
        torch.testing.assert_close(
            ours[layer][0, :, prefix:].double().cpu(), expected[layer][:, prefix:].double(), rtol=1e-3, atol=1e-6
        )


def _pass_scores(dtype, case="padded-partial-chunks"):
    """One pass of ``case`` with every tensor in ``dtype``: (scores (B, H_kv, n) float32, output)."""
    lengths, sinks, starts, ends, own_padding = PASS_CASES[case]
    bsz, n, t = len(lengths), 30, 7
    ctx_k, ctx_v = _rand(bsz, H_KV, n, D, seed=1).to(dtype), _rand(bsz, H_KV, n, D, seed=2).to(dtype)
    ctx_pos = torch.full((bsz, n), -1)
    for b, length in enumerate(lengths):
        ctx_pos[b, n - length :] = torch.arange(length)
    q = (_rand(bsz, H_Q, t, D, seed=3) * 2).to(dtype)
    own_k, own_v = _rand(bsz, H_KV, t, D, seed=4).to(dtype), _rand(bsz, H_KV, t, D, seed=5).to(dtype)
    own_pos = torch.tensor(
        [[-1] * pad + [length + i for i in range(t - pad)] for length, pad in zip(lengths, own_padding)]
    )
    module = SimpleNamespace(layer_idx=0, o_proj=SimpleNamespace(weight=_rand(HIDDEN, H_Q * D, seed=6).to(dtype)))
    scores = [torch.zeros(bsz, H_KV, n)]
    layer = PendingLayer(module, ctx_k, ctx_v, ctx_pos, D**-0.5, None)
    cache = ReconstructionCache([layer], torch.tensor(starts), torch.tensor(ends), torch.tensor(sinks), scores)
    cache.begin_chunk(own_pos)
    out = cache.attend(module, q, own_k, own_v, D**-0.5)
    return scores[0], out, own_pos >= 0


def test_bfloat16_pass_scores_in_float32_close_to_an_all_float32_pass():
    """A bf16 model's pass multiplies in bf16 (as its own attention and KVzip's reference do) but keeps
    the softmax, weights and scores in float32: the scores stay float32 and within bf16 rounding of an
    all-float32 pass on the same (bf16-representable) inputs, and so does the attention output."""
    exact, exact_out, real = _pass_scores(torch.float32)
    half, half_out, _ = _pass_scores(torch.bfloat16)
    assert half.dtype == torch.float32 and half_out.dtype == torch.bfloat16
    scored = exact > 0
    assert bool(scored.any()) and bool((half[scored] > 0).all()) and bool((half[~scored] == 0).all())
    torch.testing.assert_close(half[scored], exact[scored], rtol=4e-2, atol=1e-3)
    for b in range(real.shape[0]):
        torch.testing.assert_close(half_out[b][:, real[b]].float(), exact_out[b][:, real[b]], rtol=4e-2, atol=2e-2)
