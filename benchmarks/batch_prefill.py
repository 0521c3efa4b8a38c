"""What prefilling documents together costs against prefilling them one at a time.

    python -m benchmarks.batch_prefill [--length 4096] [--batch 4] [--repeats 2] [--cache-size 0.4]
                                       [--methods criticalkv-shares-kvzap,criticalkv-shares-kvzap[prefill_chunk=1024]]
                                       [--out benchmarks/results/batch_prefill.md]

The batch path (a sweep's shared prefill, a job with ``--no-continuous``) prefills ``B`` documents as
one left-padded batch; continuous batching prefills them one at a time. Per method this times both on
the same ``B`` documents of different lengths (``length - 97·b`` tokens, so every row but the longest
is padded), interleaved (round r runs the batch first, round r+1 the single rows first), median over
``--repeats``, and prints the batch's time over the single rows' total: 1.0 means batching costs
nothing extra on this machine; above 1 the padded batch does work the single rows do not.

SmolLM2 fp32 on CPU, ``Engine.compress_contexts`` (prefill and compression of the contexts only).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import context_ids, variant_engine
from benchmarks.roofline import header, median, table
from pipeline.engine.config import ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.loading import load_model
from pipeline.engine.types import Request
from pipeline.options import split_top_level

HERE = Path(__file__).resolve().parent
PADDING_STEP = 97  # tokens by which each row is shorter than the one before


def requests_of(tokenizer, length: int, batch: int) -> list[Request]:
    """``batch`` documents of ``length - 97·b`` tokens (b = 0 … batch - 1) cut from one sample text."""
    ids = context_ids(tokenizer, length)[0].tolist()
    return [Request(f"doc{b}", tokenizer.decode(ids[: length - PADDING_STEP * b]), ["?"]) for b in range(batch)]


def seconds_of(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(engine: Engine, requests: list[Request], repeats: int) -> tuple[float, float]:
    """Median seconds of the batch prefill and of the rows one at a time (summed), interleaved."""
    engine.compress_context(requests[-1])  # warm up
    together, alone = [], []
    for r in range(repeats):
        for batched in (True, False) if r % 2 == 0 else (False, True):
            if batched:
                together.append(seconds_of(lambda: engine.compress_contexts(requests)))
            else:
                alone.append(sum(seconds_of(lambda q=q: engine.compress_context(q)) for q in requests))
    return median(together), median(alone)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=4096, help="the longest document's tokens (default %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="documents per batch (default %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="rounds per method (default %(default)s)")
    p.add_argument("--cache-size", type=float, default=0.4, help="(default %(default)s)")
    p.add_argument(
        "--methods",
        default="none,criticalkv-shares-kvzap,criticalkv-shares-kvzap[prefill_chunk=1024]",
        help="methods, with knob overrides as in the sweeps (default %(default)s)",
    )
    p.add_argument("--out", default=str(HERE / "results" / "batch_prefill.md"))
    args = p.parse_args()
    if args.batch < 2 or args.length <= PADDING_STEP * args.batch:
        p.error(f"--batch must be at least 2 and --length above {PADDING_STEP} x --batch")
    loaded = load_model(ModelConfig(name="smollm2"))
    requests = requests_of(loaded.tokenizer, args.length, args.batch)
    rows = []
    for method in (m.strip() for m in split_top_level(args.methods) if m.strip()):
        together, alone = measure(variant_engine(loaded, method, args.cache_size), requests, args.repeats)
        rows.append([method, f"{together:.1f}", f"{alone:.1f}", f"{together / alone:.2f}"])
        print(f"{method}: batch {together:.1f} s, rows one at a time {alone:.1f} s", flush=True)
    lines = [header(f"Batch prefill against single rows (SmolLM2 fp32, cache size {args.cache_size:g})")]
    lines.append(
        f"\n{args.batch} documents of {args.length} down to {args.length - PADDING_STEP * (args.batch - 1)} "
        f"tokens, median of {args.repeats}\n"
    )
    headings = ["method", "batch s", "rows one at a time s", "batch ÷ rows"]
    lines.append(table(headings, rows, "lrrr"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
