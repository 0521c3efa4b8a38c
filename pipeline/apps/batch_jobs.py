"""Command line of the batch jobs (``jobs/longdoc_qa.py``, ``jobs/summarize.py``).

The flags are generated from the job's config (:class:`~pipeline.distributed.config.LongDocQAJob`,
:class:`~pipeline.distributed.config.SummarizeJob`) by :mod:`pipeline.options`: the job's defaults,
then a YAML file given with ``--config job.yaml`` (keys as in the config, e.g.
``compression: {method: snapkv, cache_size: 0.3}``), then the flags actually typed. Every value is
validated before Ray starts; a bad one exits with code 2 and a message naming the flag and field.
Answers with a reference are scored with their task's metric (:func:`pipeline.eval.scoring.score_answer`).
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

from pipeline.apps.self_calibration import calibrate_for_job
from pipeline.data.locations import is_uri
from pipeline.distributed.config import JOB_CONFIGS, JobConfig
from pipeline.distributed.driver import JobConfigError, JobFailed, run_job
from pipeline.eval.metrics import METRICS
from pipeline.eval.scoring import score_answer
from pipeline.options import OptionParser, fail

from .interrupts import run_interruptibly

DESCRIPTIONS = {
    "longdoc_qa": "Answer questions about long documents with a compressed KV cache, on Ray.",
    "summarize": "Summarise long documents with a compressed KV cache, on Ray.",
}


def build_parser(job: str) -> OptionParser:
    return OptionParser(
        JOB_CONFIGS[job],
        prog=f"python jobs/{job}.py",
        description=DESCRIPTIONS[job],
        epilog="With no arguments: built-in sample documents, SmolLM2 on CPU, output under outputs/.",
    )


def config_from_args(job: str, argv: list[str] | None = None) -> JobConfig:
    """Parse ``argv`` into a validated job config; exits with code 2 naming the bad flag."""
    config, _ = build_parser(job).parse(argv)
    if config.metric not in METRICS:
        fail(f"invalid --metric (metric): unknown metric {config.metric!r}; choose one of {', '.join(sorted(METRICS))}")
    if not is_uri(config.output) and not Path(config.output).is_absolute() and "working_dir_files" in os.getcwd():
        print(
            f"warning: --output {config.output} is relative and this runs inside Ray's temporary copy of the "
            f"working dir ({os.getcwd()}); pass an absolute path on storage that outlives the job",
            file=sys.stderr,
        )
    return config


EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_ROW_ERRORS = 0, 1, 2, 3


def exit_code(result, max_error_fraction: float) -> int:
    """0 when no committed row carries an error (or at most ``max_error_fraction`` of them), else 3."""
    if result.total_rows and result.rows_with_error / result.total_rows > max_error_fraction:
        return EXIT_ROW_ERRORS
    return EXIT_OK


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run(config: JobConfig):
    """The job's result, or an exit code for a failure part-way (bad configuration exits 2). A method
    with the learned scorer on a model without a KVzap file calibrates it first (``--calibrate auto``)."""
    try:
        config, calibration = calibrate_for_job(config, _log)
        return run_job(config, score=partial(score_answer, default_metric=config.metric), calibration=calibration)
    except JobConfigError as exc:
        fail(f"invalid {exc.field}: {exc.message}")
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def main(job: str, argv: list[str] | None = None) -> int:
    """Exit codes: 0 every row answered; 3 finished but rows carry an error (above --max-error-fraction);
    2 bad input or configuration (nothing ran); 1 failed part-way (committed rows stay, rerun resumes);
    130 / 143 interrupted by Ctrl-C / SIGTERM."""
    parsed: list[JobConfig] = []

    def work():  # parsing too: checking an object-store input or output may wait on the network
        parsed.append(config_from_args(job, argv))
        return _run(parsed[0])

    result = run_interruptibly(work)
    if isinstance(result, int):
        return result
    config = parsed[0]
    calibration = result.extra.get("calibration")
    if calibration:
        how = "reused" if calibration["reused"] else f"calibrated in {calibration['seconds']:.0f} s on"
        fit = calibration.get("fit") or {}
        quality = f", held-out R2 {fit['r2']:.3f}" if "r2" in fit else ""
        print(f"learned scorer: {how} {len(calibration.get('documents') or [])} of your documents{quality}; "
              f"{calibration['path']}", flush=True)  # fmt: skip
    print(
        json.dumps(
            {
                "output": str(result.output_dir),
                "rows": result.total_rows,
                "rows_written": result.rows_written,
                "rows_with_error": result.rows_with_error,
                "run_id": result.run_id,
            }
        )
    )
    code = exit_code(result, config.max_error_fraction)
    if code == EXIT_ROW_ERRORS:
        print(
            f"error: {result.rows_with_error} of {result.total_rows} rows carry an error (more than "
            f"--max-error-fraction {config.max_error_fraction:g}); see the error column",
            file=sys.stderr,
        )
    return code


def longdoc_qa() -> int:
    """Console script ``criticalkv-longdoc-qa`` (= ``python jobs/longdoc_qa.py``)."""
    return main("longdoc_qa")


def summarize() -> int:
    """Console script ``criticalkv-summarize`` (= ``python jobs/summarize.py``)."""
    return main("summarize")
