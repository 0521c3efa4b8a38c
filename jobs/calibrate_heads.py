"""HeadKV calibration: per-head retrieval scores from needle copy tests, written as a priors JSON.

    python jobs/calibrate_heads.py --model smollm2 --output priors.json \
        [--lengths 512,1024 --depths 5 --samples 2]

The file is what ``--head-priors`` (the ``headkv-*`` methods) reads; the recipe and the file format
are in :mod:`pipeline.eval.calibration`. Runs locally: one forward per (length, depth, sample).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from pipeline.cli_args import add_model_args, fail, format_validation_error
from pipeline.config import ModelConfig
from pipeline.engine.loading import load_model
from pipeline.eval.calibration import (
    MATCHES,
    build_cases,
    calibrate,
    priors_document,
    write_priors,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--output", required=True, help="priors JSON file to write")
    p.add_argument("--lengths", default="512,1024", help="context + question tokens, comma separated")
    p.add_argument("--depths", type=int, default=5, help="number of needle depths, evenly spread over 0-100 %%")
    p.add_argument("--samples", type=int, default=2, help="needles per (length, depth)")
    p.add_argument("--kinds", default="numbers,words", help="needle values: numbers, words (alternating)")
    p.add_argument("--match", default="position", choices=MATCHES,
                   help="hit = the copied needle token's own position, or any needle position with that token")
    p.add_argument("--haystack", default="essay", choices=["essay", "noise"])
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        fail(f"--lengths: expected comma separated integers, got {args.lengths!r}")
    if args.depths < 1 or args.samples < 1 or not lengths:
        fail("--depths, --samples and --lengths must be positive")
    depths = [round(100.0 * i / (args.depths - 1), 2) if args.depths > 1 else 50.0 for i in range(args.depths)]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    try:
        model_cfg = ModelConfig(name=args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    except ValidationError as exc:
        fail(format_validation_error(exc))
    t0 = time.perf_counter()
    loaded = load_model(model_cfg)
    try:
        cases = build_cases(loaded.tokenizer, lengths, depths, args.samples, args.seed, kinds, args.haystack)
    except ValueError as exc:
        fail(str(exc))
    log = lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    result = calibrate(loaded.model, cases, args.match, progress=log)
    settings = {"seed": args.seed, "samples": args.samples, "haystack": args.haystack, "device": str(loaded.device),
                "dtype": str(loaded.dtype).replace("torch.", "")}
    doc = priors_document(args.model, loaded.model.config, result, settings)
    path = write_priors(args.output, doc)
    scores = result.scores
    order = scores.flatten().argsort(descending=True)[:8].tolist()
    top = ", ".join(f"L{i // scores.shape[1]}H{i % scores.shape[1]}={float(scores.flatten()[i]):.2f}" for i in order)
    print(f"{len(cases)} cases, copy accuracy {doc['settings']['copy_accuracy']:.2f}, top heads: {top}")
    print(f"wrote {path} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
