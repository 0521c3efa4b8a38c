"""Side by side with kvpress 0.5.5 (NVIDIA's reference implementation of CriticalKV), on SmolLM2.

kvpress needs transformers 5.2 and pandas < 3, so it runs in its own virtual environment, made by
this script on first use (``--kvpress-venv``, default ``<model cache>/kvpress-venv``: torch 2.13.0
first, then ``kvpress==0.5.5 transformers==5.2.0 "pandas<3"`` with torch held by a constraint
file; idempotent, guarded by a lock). ``benchmarks/kvpress/side.py`` runs there and answers JSON
requests over a pipe; both sides load the same safetensors folder and receive the same token ids.
Both run fp32 on the same CPU threads; runs are interleaved (ours, kvpress, kvpress, ours, ...) and
every time is a median over ``--repeats``.

Sections:

1. Faithfulness: matched settings (window 64, avg-pool kernel 5, alpha 0.5, eps 1e-4, alpha_safe
   0.2, kvpress's budget ``int(n * cache_size)`` passed to ours as an absolute budget): kept
   positions per (layer, KV head) of ours vs kvpress for snapkv / criticalkv-snapkv (uniform) and,
   as extra rows, adakv-snapkv / criticalkv-adakv-snapkv; Jaccard, identical heads, score gaps
   at the differing entries; optionally kvpress in bf16 (``--faith-dtypes``).
2. Time per document: prefill + compression + question + ``--new-tokens`` greedy tokens (EOS
   disabled on both sides so both decode exactly as many), ours (the Engine) vs kvpress
   (``KVPressTextGenerationPipeline._forward``'s calls), per method pair, ratio ours/kvpress.
3. Memory actually held by the KV cache after prefill: ours (variable-length store) vs kvpress
   (pruned tensors for uniform presses, full-size masked tensors for AdaKV presses).
4. Batch of ``--batch`` documents of different lengths (``--batch-length`` tokens for the longest, then
   10 % shorter each) with criticalkv-adakv-snapkv: ours with
   ``batch_size=B`` (left padded) and one by one vs kvpress one by one; kvpress's batched
   ``CriticalAdaKVPress`` is tried once on equal-length rows and its outcome reported.
5. Against the limit: decode ms/token vs (weights + KV entries read) / measured bandwidth, and
   CriticalKV norm time vs (norm FLOPs actually computed) / measured matmul throughput.

Usage: python -m benchmarks.kvpress.vs_kvpress [--lengths 2048,4096] [--faith-lengths 2048,4096]
       [--repeats 3] [--new-tokens 32] [--cache-size 0.2] [--batch 4] [--batch-length 2048]
       [--sections 1,2,3,4,5] [--faith-dtypes float32,bfloat16] [--bf16-max-tokens 2048]
       [--out benchmarks/results/vs_kvpress.md] [--setup-only]

Development on a shared machine: ``--lengths 512 --faith-lengths 512 --repeats 1 --new-tokens 8``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from benchmarks.kvpress.common import KvpressSide, Report, dir_size, ensure_kvpress_venv
from benchmarks.kvpress.faithfulness import section_faithfulness
from benchmarks.kvpress.limits import section_batch, section_limits
from benchmarks.kvpress.timing import section_memory, section_time
from benchmarks.roofline import RESULTS_DIR, header, measure_limits, model_shape, parse_ints


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096", help="context tokens for sections 2, 3, 5")
    p.add_argument("--faith-lengths", default="2048,4096", help="context tokens for section 1")
    p.add_argument("--faith-dtypes", default="float32,bfloat16", help="model dtypes (both sides) for section 1")
    p.add_argument(
        "--bf16-max-tokens",
        type=int,
        default=2048,
        help="section 1: non-fp32 rows only up to this length (slow on CPU)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cache-size", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument(
        "--batch-length", type=int, default=None, help="longest document of the batch (default: min of --lengths)"
    )
    p.add_argument("--methods", default="none,snapkv,criticalkv-snapkv,criticalkv-adakv-snapkv")
    p.add_argument("--sections", default="1,2,3,4,5")
    p.add_argument("--per-layer", action="store_true", help="section 1: print per-layer mean Jaccard")
    p.add_argument("--kvpress-venv", default=None)
    p.add_argument("--setup-only", action="store_true", help="create the kvpress venv and exit")
    p.add_argument(
        "--out", default=str(RESULTS_DIR / "vs_kvpress.md"), help="also write the Markdown here ('' = don't)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = ensure_kvpress_venv(Path(args.kvpress_venv) if args.kvpress_venv else None)
    if args.setup_only:
        size = info["size"] if info["size"] is not None else dir_size(Path(info["python"]).parents[1])
        how = f"created in {info['seconds']:.0f} s" if info["created"] else "already there"
        print(f"kvpress venv: {info['python']} ({how}, {size / 2**30:.2f} GiB)")
        return

    from benchmarks.common import load_smollm2
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.loading import resolve_model_path

    out = Report()
    out(header("Side by side with kvpress 0.5.5 on SmolLM2-135M-Instruct"))
    loaded = load_smollm2()
    model_dir, _ = resolve_model_path(ModelConfig(name="smollm2"))
    log_path = Path(tempfile.gettempdir()) / f"kvpress_side-{os.getpid()}.log"
    with KvpressSide(info["python"], model_dir, torch.get_num_threads(), log_path) as side:
        hello = side.request("hello")
        out(
            f"- kvpress side: kvpress {hello['kvpress']}, transformers {hello['transformers']}, torch {hello['torch']} "
            f"({hello['threads']} threads, attention `{hello['attn_implementation']}`), "
            f"venv `{Path(info['python']).parents[1]}`"
        )
        out(f"- both sides: fp32 weights from `{model_dir}`, same token ids")
        run_sections(out, args, loaded, side)
    out.write(Path(args.out) if args.out else None)


def run_sections(out: Report, args: argparse.Namespace, loaded, side: KvpressSide) -> None:
    """The sections asked for with ``--sections``, in order (2 feeds 3 and 5)."""
    sections = set(parse_ints(args.sections))
    shape = model_shape(loaded.model)
    limits = measure_limits() if 5 in sections else None
    if 1 in sections:
        dtypes = [d for d in args.faith_dtypes.split(",") if d]
        faith = parse_ints(args.faith_lengths)
        section_faithfulness(out, loaded, side, faith, args.cache_size, dtypes, args.per_layer, args.bf16_max_tokens)
    results = []
    if sections & {2, 3, 5}:
        methods = [m for m in args.methods.split(",") if m]
        lengths = parse_ints(args.lengths)
        results = section_time(out, loaded, side, lengths, args.cache_size, args.repeats, args.new_tokens, methods)
    if 3 in sections:
        section_memory(out, results, args.cache_size, shape)
    if 4 in sections:
        n = args.batch_length or min(parse_ints(args.lengths))
        section_batch(out, loaded, side, n, args.batch, args.cache_size, args.repeats, args.new_tokens)
    if 5 in sections and results:
        limits = measure_limits().best(limits)  # best of start and end of the run
        section_limits(out, results, limits, shape, args.new_tokens)


if __name__ == "__main__":
    main()
