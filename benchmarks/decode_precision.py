"""How far a bf16 decode step over a uniform cache moves with the dense-view kernel, on real weights.

    python -m benchmarks.decode_precision [--length 2048] [--steps 32] [--cache-size 0.4] [--docs 3]

The dense view of a uniform cache is read with grouped matmuls (:func:`pipeline.kv.attention.
grouped_decode_attention`: logits rounded to the cache's dtype, then an fp32 softmax, as transformers'
eager attention and the ``blocked`` kernel do) or with SDPA (fused; no rounding of the logits). On a
GPU the grouped path is the default since its steps measured 2.3–2.5× faster
(``docs/results/gpu/README.md``). This measures what it costs in precision: SmolLM2 in bfloat16 on
CPU, ``snapkv`` at ``--cache-size`` (a uniform cache), each document's cache prefilled once and copied;
the greedy tokens of the float32 model's full-precision run are teacher-forced through both kernels, and
the last-token logits of every step compared with that float32 reference (max |Δ| and top-1 agreement)
and between the two kernels.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import context_ids
from benchmarks.gpu_batch import batch_of
from pipeline.engine.config import ModelConfig
from pipeline.engine.loading import load_model
from pipeline.kv.attention.registered import register
from pipeline.kv.attention.varlen_kernels import KernelChoice
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.storage.cache import VarLenCache, run_chunk

KERNELS = ("grouped", "sdpa")


@torch.inference_mode()
def step_logits(model, cache: VarLenCache, tokens: list[int], start: int) -> torch.Tensor:
    """Teacher-forced decode steps of ``tokens`` (one per step) -> (steps, vocab) float32 logits."""
    out = []
    for i, token in enumerate(tokens):
        ids = torch.tensor([[token]])
        logits = run_chunk(model, cache, ids, torch.tensor([[start + i]]), logits_to_keep=1)
        out.append(logits.logits[0, -1].float())
    return torch.stack(out)


@torch.inference_mode()
def compare_document(models: dict, ids: torch.Tensor, config: CompressionConfig, steps: int) -> dict:
    """Per kernel (and the fp32 reference): step logits of the same teacher-forced tokens."""
    n = ids.shape[1]
    caches = {}
    for dtype_name, model in models.items():
        cache = VarLenCache(model.config.num_hidden_layers, Compressor(config))
        first = run_chunk(model, cache, ids, torch.arange(n)[None], logits_to_keep=1)
        cache.reserve(steps + 1)
        caches[dtype_name] = (cache, first.logits[0, -1])
    ref_cache, ref_first = caches["float32"]
    tokens = [int(ref_first.argmax())]
    ref = []
    for i in range(steps):  # the float32 model's greedy continuation
        logits = run_chunk(models["float32"], ref_cache, torch.tensor([[tokens[-1]]]), torch.tensor([[n + i]]))
        ref.append(logits.logits[0, -1].float())
        tokens.append(int(ref[-1].argmax()))
    ref = torch.stack(ref)
    half_cache = caches["bfloat16"][0]
    out, got = {}, {}
    for kernel in KERNELS:
        cache = batch_of(half_cache, 1, KernelChoice(dense=kernel))  # a copy, read with that kernel
        got[kernel] = step_logits(models["bfloat16"], cache, tokens[:steps], n)
        out[kernel] = {
            "max_abs": float((got[kernel] - ref).abs().max()),
            "top1": float((got[kernel].argmax(-1) == ref.argmax(-1)).float().mean()),
            "kernels": sorted(cache.kernels_used),
        }
    between = float((got["grouped"] - got["sdpa"]).abs().max())
    return {"kernels": out, "between": between, "ref_scale": float(ref.abs().max())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048, help="context tokens (default: %(default)s)")
    p.add_argument("--steps", type=int, default=32, help="decode steps (default: %(default)s)")
    p.add_argument("--cache-size", type=float, default=0.4, help="snapkv's kept fraction (default: %(default)s)")
    p.add_argument("--docs", type=int, default=3, help="documents (default: %(default)s)")
    args = p.parse_args(argv)
    models = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(ModelConfig(name="smollm2", device="cpu", dtype=dtype))
        loaded.model.set_attn_implementation(register())
        models[dtype], tokenizer = loaded.model, loaded.tokenizer
    config = CompressionConfig(method="snapkv", cache_size=args.cache_size)
    print(
        "| document | kernel | max abs Δ logit vs float32 | top-1 agreement | max abs Δ grouped vs sdpa | max |logit| |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for doc in range(args.docs):
        ids = context_ids(tokenizer, args.length, seed=1000 * doc)
        result = compare_document(models, ids, config, args.steps)
        for kernel, r in result["kernels"].items():
            between = f"{result['between']:.3f}" if kernel == KERNELS[0] else ""
            cells = f"{r['max_abs']:.3f} | {r['top1']:.3f} | {between} | {result['ref_scale']:.1f}"
            print(f"| {doc} | {kernel} ({','.join(r['kernels'])}) | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
