"""Perturbation diagnostics (the CriticalKV paper's analysis) on one model, written to Parquet.

    python jobs/perturbation.py --model smollm2 --length 2048 --cache-size 0.2 \
        --methods snapkv,criticalkv-snapkv,adakv-snapkv,criticalkv-adakv-snapkv --output OUT

Writes ``OUT/perturbation.parquet`` (one row per document x method x cache size x layer x KV head;
columns and formulas in :mod:`pipeline.eval.perturbation`) and ``OUT/headline.json``, and prints
the fraction of (document, layer, KV head) where each ``criticalkv-X`` method has a lower
attention-output perturbation than ``X``. Runs locally (no Ray): one full forward per document.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from pipeline.cli_args import add_knob_args, add_model_args, fail, format_validation_error
from pipeline.config import CompressionConfig, ModelConfig
from pipeline.engine.loading import load_model
from pipeline.eval.calibration import shipped_priors
from pipeline.eval.perturbation import (
    continuation_documents,
    format_headline,
    headline,
    method_configs,
    question_documents,
    run_perturbation,
)

DEFAULT_METHODS = "snapkv,criticalkv-snapkv,adakv-snapkv,criticalkv-adakv-snapkv"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--output", required=True, help="output folder")
    p.add_argument("--length", type=int, default=2048, help="context tokens (question docs: context + question)")
    p.add_argument("--cache-size", default="0.2", help="kept fraction(s), comma separated")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma separated method names")
    p.add_argument("--queries", default="question", choices=["question", "continuation", "both"],
                   help="later queries: RULER question + teacher-forced answer, the context's next tokens, or both")
    p.add_argument("--samples", type=int, default=1, help="documents per query kind")
    p.add_argument("--query-tokens", type=int, default=64, help="continuation: later tokens per document")
    p.add_argument("--task", default="niah_single_2", help="RULER task of the question documents")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-queries", type=int, default=None,
                   help="last context queries of the in-sample 'window' probe (default: --window; 0 = off)")
    g = p.add_argument_group("compression knobs shared by every method")
    add_knob_args(g)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        sizes = [float(s) for s in args.cache_size.split(",") if s.strip()]
    except ValueError:
        fail(f"--cache-size: expected comma separated numbers, got {args.cache_size!r}")
    priors = args.head_priors
    if priors is None and any("headkv" in m for m in methods):
        priors = shipped_priors(args.model)
        if priors is None:
            fail(f"--head-priors: headkv methods need a priors file and none is shipped for {args.model!r}")
    try:
        model_cfg = ModelConfig(name=args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
        base = CompressionConfig(
            window=args.window, kernel=args.kernel, pooling=args.pooling, first_stage_ratio=args.first_stage_ratio,
            epsilon=args.epsilon, norm=args.norm, alpha_safeguard=args.alpha_safeguard, head_priors=priors,
        )
        configs = method_configs(methods, sizes, base)
    except ValidationError as exc:
        fail(format_validation_error(exc))
    t0 = time.perf_counter()
    loaded = load_model(model_cfg)
    docs = []
    if args.queries in ("question", "both"):
        docs += question_documents(loaded.tokenizer, args.length, args.samples, args.seed, args.task)
    if args.queries in ("continuation", "both"):
        docs += continuation_documents(loaded.tokenizer, args.length, args.samples, args.query_tokens, args.seed)
    log = lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    table = run_perturbation(loaded.model, docs, configs, model_name=args.model, progress=log,
                             window_queries=args.window_queries)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "perturbation.parquet")
    rows = headline(table)
    (out / "headline.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(format_headline(rows) or "no criticalkv-X / X pair among --methods")
    print(f"wrote {out / 'perturbation.parquet'} ({table.num_rows} rows) in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
