"""``jobs/eval_compression.py``: a compression sweep on Ray, scored, with a report.

    python jobs/eval_compression.py --tasks niah_single_1,vt --length 2048 --samples 5 \\
        --methods snapkv,criticalkv-snapkv --cache-sizes 0.2,0.4,1.0 [--query-aware] --output OUT

1. RULER-style documents are generated offline, their lengths fitted with the model's tokenizer;
2. every (method, cache size) plus one full-cache reference is answered for every document by the
   same Ray pipeline as the other jobs (resume, atomic commits, manifest), each context prefilled
   once per document and each setting's cache derived from that prefill;
3. every answer is scored with its task's RULER metric (``score`` column, ``task`` column), and
   ``OUT/report.md`` + plots are written.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from ..cli_args import add_knob_args, add_model_args, default_head_priors, format_validation_error
from ..config import METHODS, CompressionConfig, GenerationConfig, ModelConfig
from .sweep import expand_for_sweep, ruler_documents, sweep_settings, token_counter

DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_multikey_1,vt"
DEFAULT_METHODS = "snapkv,criticalkv-snapkv,adakv-snapkv,criticalkv-adakv-snapkv,headkv-snapkv,criticalkv-headkv-snapkv"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jobs/eval_compression.py", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated RULER tasks")
    p.add_argument("--length", type=int, default=2048, help="prompt length in the model's tokens")
    p.add_argument("--samples", type=int, default=5, help="documents per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, from: {', '.join(METHODS)}")
    p.add_argument("--cache-sizes", default="0.2,0.4,1.0", help="kept fractions; 1.0 adds the full-cache reference")
    p.add_argument("--max-new-tokens", type=int, default=24, help="cap on RULER's per-task generation length")
    p.add_argument("--output", required=True,
                   help="output directory or s3:// / gs:// prefix (rerun into it to resume)")
    p.add_argument("--report-dir", default=None,
                   help="local directory for report.md and plots (default: --output; required when it is a URI)")
    p.add_argument("--num-actors", type=int, default=1)
    p.add_argument("--cpus-per-actor", type=float, default=None)
    p.add_argument("--gpus-per-actor", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=1)
    g = p.add_argument_group("compression knobs shared by every setting")
    add_knob_args(g)
    g.add_argument("--query-aware", action="store_true", help="question inside the observation window")
    add_model_args(p)
    return p


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from ..distributed.driver import JobConfigError, JobFailed, run_job
    from ..engine.loading import ModelNotFoundError, resolve_model_path
    from ..job_config import JobConfig
    from ..report import build_report
    from ..storage import is_uri

    args = build_parser().parse_args(argv)
    if args.report_dir is None and is_uri(args.output):
        _fail("invalid report_dir: --output is a URI; give --report-dir, a local directory for the report")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        sizes = [float(x) for x in args.cache_sizes.split(",") if x.strip()]
    except ValueError:
        _fail(f"invalid cache_sizes: {args.cache_sizes!r} is not a comma-separated list of numbers")
    try:
        model = ModelConfig(name=args.model, device=args.device, dtype=args.dtype,
                            trust_remote_code=args.trust_remote_code, max_context_tokens=args.max_context_tokens)
        priors = args.head_priors or (default_head_priors(args.model) if any("headkv" in m for m in methods) else None)
        base = CompressionConfig(window=args.window, kernel=args.kernel, pooling=args.pooling,
                                 first_stage_ratio=args.first_stage_ratio, epsilon=args.epsilon, norm=args.norm,
                                 alpha_safeguard=args.alpha_safeguard, head_priors=priors, query_aware=args.query_aware)
        settings = sweep_settings(methods, sizes, base)
    except ValidationError as exc:
        _fail(format_validation_error(exc))
    except ValueError as exc:
        _fail(f"invalid {exc}")
    try:
        path, extra = resolve_model_path(model)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code, **extra)
    except (ModelNotFoundError, OSError, ValueError) as exc:
        _fail(f"invalid model: {exc}")
    try:
        docs = ruler_documents([t.strip() for t in args.tasks.split(",") if t.strip()], args.length, args.samples,
                               token_counter(tokenizer), seed=args.seed, max_new_tokens=args.max_new_tokens)
    except ValueError as exc:
        _fail(f"invalid {exc}")
    for doc in docs:
        doc.pop("metric")
    inputs = Path(tempfile.mkdtemp(prefix="criticalkv-eval-")) / "documents.parquet"
    pq.write_table(pa.Table.from_pylist(expand_for_sweep(docs, settings)), inputs)
    print(f"{len(docs)} documents x {len(settings)} settings ({', '.join(f'{s.method}@{s.cache_size:g}' for s in settings)})")
    try:
        config = JobConfig(
            job="eval_compression", input=str(inputs), output=args.output, model=model,
            compression=settings[0], sweep=settings,
            generation=GenerationConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size),
            min_actors=args.num_actors, max_actors=args.num_actors,
            cpus_per_actor=args.cpus_per_actor, gpus_per_actor=args.gpus_per_actor,
        )
        run_job(config)
    except ValidationError as exc:
        _fail(format_validation_error(exc))
    except JobConfigError as exc:
        _fail(f"invalid {exc}")
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report = build_report([args.output], Path(args.report_dir or args.output))
    print(f"report: {report}")
    return 0
