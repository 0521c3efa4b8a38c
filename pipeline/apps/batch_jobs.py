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
from pathlib import Path

from pipeline.data.locations import is_uri
from pipeline.distributed.config import JOB_CONFIGS, JobConfig
from pipeline.distributed.driver import JobConfigError, JobFailed, run_job
from pipeline.eval.scoring import score_answer
from pipeline.options import OptionParser, fail

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
    if not is_uri(config.output) and not Path(config.output).is_absolute() and "working_dir_files" in os.getcwd():
        print(
            f"warning: --output {config.output} is relative and this runs inside Ray's temporary copy of the "
            f"working dir ({os.getcwd()}); pass an absolute path on storage that outlives the job",
            file=sys.stderr,
        )
    return config


def main(job: str, argv: list[str] | None = None) -> int:
    config = config_from_args(job, argv)
    try:
        result = run_job(config, score=score_answer)
    except JobConfigError as exc:
        fail(f"invalid {exc.field}: {exc.message}")
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "output": str(result.output_dir),
                "rows": result.total_rows,
                "rows_written": result.rows_written,
                "run_id": result.run_id,
            }
        )
    )
    return 0
