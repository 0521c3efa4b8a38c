"""Command line of the batch jobs (``jobs/longdoc_qa.py``, ``jobs/summarize.py``).

Settings come from three layers, later ones winning: the job's defaults, a YAML file given with
``--config job.yaml`` (keys as in :class:`pipeline.job_config.JobConfig`, e.g.
``compression: {method: snapkv, cache_size: 0.3}``), and the flags actually typed. Every value is
validated by the pydantic configs before Ray starts; a bad one exits with code 2 and a message
naming the field (``invalid compression.method: ...``, ``invalid output: ...``).

Fault injection for tests is read from ``$CRITICALKV_FAULTS`` (JSON, see ``FaultConfig``); no flag.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from pipeline.cli_args import (
    add_compression_args,
    add_generation_args,
    add_model_args,
    default_head_priors,
    format_validation_error,
)
from pipeline.data.synthetic import SUMMARY_INSTRUCTION
from pipeline.job_config import FaultConfig, JobConfig
from pipeline.storage import is_uri

DESCRIPTIONS = {
    "longdoc_qa": "Answer questions about long documents with a compressed KV cache, on Ray.",
    "summarize": "Summarise long documents with a compressed KV cache, on Ray.",
}
# defaults that differ from the library's: the jobs show compression at work out of the box
JOB_DEFAULTS = {
    "longdoc_qa": {"method": "criticalkv-snapkv", "cache_size": 0.5, "max_new_tokens": 24,
                   "sample_docs": 3, "sample_words": 800},
    "summarize": {"method": "criticalkv-snapkv", "cache_size": 0.5, "max_new_tokens": 64,
                  "sample_docs": 2, "sample_words": 400, "instruction": SUMMARY_INSTRUCTION},
}
COLUMN_FLAGS = {  # flag dest -> ColumnMapping field
    "id_column": "id", "context_column": "context", "question_column": "question",
    "questions_column": "questions", "question_id_column": "question_id", "reference_column": "reference",
    "answer_prefix_column": "answer_prefix", "max_new_tokens_column": "max_new_tokens",
}
MODEL_FLAGS = {"model": "name", "device": "device", "dtype": "dtype", "trust_remote_code": "trust_remote_code",
               "max_context_tokens": "max_context_tokens"}
COMPRESSION_FLAGS = ("method", "cache_size", "budget", "window", "kernel", "pooling", "first_stage_ratio",
                     "epsilon", "norm", "alpha_safeguard", "head_priors", "max_cache_tokens", "query_aware")
GENERATION_FLAGS = ("max_new_tokens", "batch_size", "truncate")
TOP_FLAGS = ("input", "output", "split", "dataset_config", "sample_docs", "sample_words", "sample_seed",
             "normalise", "rows_per_file", "retry_errors", "instruction", "min_actors", "max_actors",
             "gpus_per_actor", "cpus_per_actor", "ray_address", "engine_factory", "oom_retry_cache_size")


def build_parser(job: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python jobs/{job}.py", description=DESCRIPTIONS[job],
        epilog="With no arguments: built-in sample documents, SmolLM2 on CPU, output under outputs/.",
    )
    p.add_argument("--config", help="YAML file with JobConfig settings (flags given here override it)")
    io = p.add_argument_group("input and output")
    io.add_argument("--input", help="Parquet file/dir, JSONL, save_to_disk dir, hub dataset, or an s3:// / gs:// URI "
                    "of Parquet or JSONL (default: built-in samples)")
    io.add_argument("--output", help="output directory or s3:// / gs:// prefix (default: a new "
                    "outputs/<job>-<timestamp>/); rerun into it to resume")
    io.add_argument("--split", help="split of a datasets directory or hub dataset")
    io.add_argument("--dataset-config", help="hub dataset configuration name")
    io.add_argument("--sample-docs", type=int, help="built-in samples: number of documents")
    io.add_argument("--sample-words", type=int, help="built-in samples: words per document")
    io.add_argument("--sample-seed", type=int, help="built-in samples: random seed")
    io.add_argument("--normalise", choices=["auto", "driver", "ray"], help="where rows are grouped into documents")
    io.add_argument("--rows-per-file", type=int, help="rows per committed Parquet file (default 64)")
    io.add_argument("--retry-errors", action="store_true", default=None, help="on resume, redo questions that failed")
    if job == "summarize":
        io.add_argument("--instruction", help="the instruction every document gets as its question")
    cols = p.add_argument_group("input columns (defaults: doc_id, context, question or questions, ...)")
    for dest in COLUMN_FLAGS:
        cols.add_argument("--" + dest.replace("_", "-"), dest=dest)
    run = p.add_argument_group("Ray resources")
    run.add_argument("--num-actors", type=int, help="fixed actor pool size (sets --min-actors and --max-actors)")
    run.add_argument("--min-actors", type=int)
    run.add_argument("--max-actors", type=int)
    run.add_argument("--gpus-per-actor", type=float, help="GPUs per actor (default 0)")
    run.add_argument("--cpus-per-actor", type=float, help="CPUs per actor (default 1 with GPUs, else 2)")
    run.add_argument("--oom-retry-cache-size", type=float,
                     help="retry a document that ran out of memory once, at this smaller cache size")
    run.add_argument("--ray-address", help="Ray cluster to use (default: $RAY_ADDRESS, else start a local Ray)")
    run.add_argument("--engine-factory", help="'module:function' building the engine (tests, custom models)")
    add_model_args(p)
    add_compression_args(p)
    add_generation_args(p, max_new_tokens=JOB_DEFAULTS[job]["max_new_tokens"])
    p.set_defaults(**{k: v for k, v in JOB_DEFAULTS[job].items()
                      if k in ("method", "cache_size", "max_new_tokens")})
    return p


def _explicit(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    """Only the options typed on the command line."""
    quiet = argparse.ArgumentParser(add_help=False)
    for action in parser._actions:  # same options, every default suppressed
        if action.option_strings and action.dest != "help":
            kwargs = {"dest": action.dest, "default": argparse.SUPPRESS}
            if isinstance(action, argparse._StoreTrueAction):
                quiet.add_argument(*action.option_strings, action="store_true", **kwargs)
            else:
                quiet.add_argument(*action.option_strings, nargs=action.nargs, **kwargs)
    known, _ = quiet.parse_known_args(argv)
    return vars(known)


def _layer(values: dict) -> dict:
    """Flat argparse values → nested JobConfig dict (None values are left out)."""
    out: dict = {"model": {}, "compression": {}, "generation": {}, "columns": {}}
    for key, value in values.items():
        if value is None:
            continue
        if key in MODEL_FLAGS:
            out["model"][MODEL_FLAGS[key]] = value
        elif key in COMPRESSION_FLAGS:
            out["compression"][key] = value
        elif key in GENERATION_FLAGS:
            out["generation"][key] = value
        elif key in COLUMN_FLAGS:
            out["columns"][COLUMN_FLAGS[key]] = value
        elif key == "num_actors":
            out["min_actors"] = out["max_actors"] = value
        elif key in TOP_FLAGS:
            out[key] = value
    return out


def _merge(base: dict, top: dict) -> dict:
    merged = dict(base)
    for key, value in top.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def default_output(job: str) -> Path:
    return Path("outputs") / f"{job}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def config_from_args(job: str, argv: list[str] | None = None) -> JobConfig:
    """Parse ``argv`` into a validated JobConfig; exits with code 2 naming the bad field."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(job)
    args = parser.parse_args(argv)
    defaults = {k: v for k, v in vars(args).items() if k not in COLUMN_FLAGS and k != "config"}
    defaults.update({k: v for k, v in JOB_DEFAULTS[job].items() if k in TOP_FLAGS or k.startswith("sample_")})
    layered = _merge({"job": job}, _layer(defaults))
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            fail(f"invalid config: no such file: {path}")
        try:
            from_file = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            fail(f"invalid config: {path} is not valid YAML: {exc}")
        if not isinstance(from_file, dict):
            fail(f"invalid config: {path} must hold a mapping of settings")
        if from_file.get("job", job) != job:
            fail(f"invalid job: {path} is for job {from_file['job']!r}, this is {job!r}")
        layered = _merge(layered, from_file)
    typed = {key: getattr(args, key) for key in _explicit(parser, argv)}  # parsed with their types
    layered = _merge(layered, _layer(typed))
    if not layered.get("output"):
        layered["output"] = str(default_output(job))
    if (not is_uri(str(layered["output"])) and not Path(layered["output"]).is_absolute()
            and "working_dir_files" in os.getcwd()):
        print(f"warning: --output {layered['output']} is relative and this runs inside Ray's temporary copy of "
              f"the working dir ({os.getcwd()}); pass an absolute path on storage that outlives the job",
              file=sys.stderr)
    compression = layered.setdefault("compression", {})
    if "headkv" in str(compression.get("method", "")) and not compression.get("head_priors"):
        compression["head_priors"] = default_head_priors(str(layered.get("model", {}).get("name", "smollm2")))
    try:
        layered["faults"] = FaultConfig.from_env().model_dump()
    except (ValueError, ValidationError) as exc:
        fail(f"invalid faults ($CRITICALKV_FAULTS): {exc}")
    try:
        return JobConfig.model_validate(layered)
    except ValidationError as exc:
        fail(format_validation_error(exc))
    raise AssertionError("unreachable")


def main(job: str, argv: list[str] | None = None) -> int:
    from pipeline.distributed.driver import JobConfigError, JobFailed, run_job

    config = config_from_args(job, argv)
    try:
        result = run_job(config)
    except JobConfigError as exc:
        fail(f"invalid {exc.field}: {exc.message}")
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"output": str(result.output_dir), "rows": result.total_rows,
                      "rows_written": result.rows_written, "run_id": result.run_id}))
    return 0
