"""``jobs/eval_compression.py``: a compression sweep on Ray, scored, with a report.

    python jobs/eval_compression.py --tasks niah_single_1,vt --length 2048 --samples 5 \\
        --methods snapkv,criticalkv-snapkv --cache-sizes 0.2,0.4,1.0 [--query-aware] --output OUT
    python jobs/eval_compression.py --input my_docs.jsonl --methods ... --output OUT   # your documents

1. the documents: RULER-style ones generated offline (their lengths fitted with the model's
   tokenizer), or the user's own (``--input``, any input of the batch jobs, with the same column flags);
2. every (method, cache size) plus one full-cache reference is answered for every document by the
   same Ray pipeline as the other jobs (resume, atomic commits, manifest), each context prefilled
   once per document and each setting's cache derived from that prefill;
3. every answer with references is scored (``score`` column): a RULER task's own metric, else
   ``--metric``; every compressed answer carries the fidelity NLL increase (the full cache's answer
   under its cache, no labels needed); ``OUT/report.md`` + plots rank the methods by both.

This module composes the distributed room (the job) and the eval room (documents, scoring).
"""

from __future__ import annotations

import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import ClassVar, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, model_validator
from transformers import AutoTokenizer

from pipeline.data.locations import is_uri
from pipeline.distributed.config import HIDDEN, JobConfig
from pipeline.distributed.driver import JobConfigError, JobFailed, run_job
from pipeline.engine.config import SweepGeneration
from pipeline.engine.loading import ModelNotFoundError, resolve_model_path
from pipeline.eval.scoring import score_answer
from pipeline.eval.sweep import sweep_documents, sweep_settings, token_counter
from pipeline.kv.config import CompressionConfig, CompressionKnobs
from pipeline.options import OptionParser, fail, first_paragraph
from pipeline.report import build_report

from .interrupts import run_interruptibly

# the RULER tasks on which the bundled SmolLM2's full cache scores >= 0.5 at 2K tokens (10 samples:
# niah_single_1/2 1.0, niah_single_3 0.9, niah_multivalue 0.83, niah_multikey_1 0.7, niah_multiquery
# 0.55; vt, cwe, fwe, niah_multikey_2/3 score <= 0.37 and cannot show what compression loses)
DEFAULT_TASKS = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multivalue",
    "niah_multiquery",
]
# one method per scorer family, with CriticalKV and the cross-layer budget where they matter most
DEFAULT_METHODS = [
    "snapkv",
    "criticalkv-snapkv",
    "knorm",
    "defensivekv",
    "criticalkv-layer-defensivekv",
    "expected_attention",
    "kvzip",
    "layer-kvzip",
    "criticalkv-layer-kvzip",
    "shares-kvzap",
    "criticalkv-shares-kvzap",
]


GENERATED_ONLY = {"tasks", "length", "samples", "seed", "summary_tokens"}  # options of the generated documents


class EvalJob(JobConfig):
    """Sweep"""

    auto_batch_size: ClassVar[int] = 1  # a sweep's batch is its settings: one document per call unless asked

    job: Literal["eval_compression"] = Field("eval_compression", json_schema_extra=HIDDEN)
    input: str | None = Field(
        None,
        description="your documents instead of generated ones: Parquet file/dir, JSONL, save_to_disk dir, hub "
        "dataset, or an s3:// / gs:// URI (the batch jobs' inputs and column flags); rows with references are "
        "scored by --metric, all rows by the fidelity NLL (default: generated RULER documents, --tasks)",
    )
    tasks: list[str] = Field(
        DEFAULT_TASKS,
        description="RULER tasks, and summary_essay for essay summaries scored "
        "by ROUGE-L against the full cache's summary",
    )
    length: int = Field(2048, ge=64, description="prompt length in the model's tokens")
    samples: int = Field(5, ge=1, description="documents per task")
    seed: int = Field(0, description="seed of the generated documents")
    summary_tokens: int = Field(128, ge=1, description="summary_essay: generated tokens at most")
    methods: list[str] = Field(
        DEFAULT_METHODS,
        description="methods swept (spellings as --method); NAME[knob=value,...] adds a variant of NAME with "
        "other knob values, e.g. snapkv[window=64,kernel=5,pooling=avg]",
    )
    cache_sizes: list[float] = Field(
        [0.2, 0.4, 1.0], description="kept fractions; 1.0 adds the full-cache reference (always run)"
    )
    report_dir: str | None = Field(
        None, description="local directory for report.md and plots (default: --output; required when it is a URI)"
    )
    # the knobs every swept method shares: --methods and --cache-sizes choose the methods and budgets
    compression: CompressionKnobs = Field(default_factory=CompressionKnobs)
    generation: SweepGeneration = Field(default_factory=lambda: SweepGeneration(max_new_tokens=24))

    @model_validator(mode="after")
    def _generated_or_own(self) -> EvalJob:
        if self.input is not None:
            unused = sorted(GENERATED_ONLY & self.model_fields_set)
            if unused:
                flags = ", ".join("--" + name.replace("_", "-") for name in unused)
                raise ValueError(f"input: {flags} describe generated documents; with --input your documents are swept")
        return self

    @classmethod
    def option_groups(cls) -> list[tuple[str, list[str]]]:
        sweep = [
            "input",
            "tasks",
            "length",
            "samples",
            "seed",
            "summary_tokens",
            "methods",
            "cache_sizes",
            "output",
            "report_dir",
        ]
        rest = super().option_groups()
        return [("sweep", sweep)] + [(title, [n for n in names if n not in sweep]) for title, names in rest]

    def compression_settings(self) -> list[CompressionConfig]:
        """The swept settings: every ``--methods`` entry at every ``--cache-sizes`` value, with the knobs."""
        return sweep_settings(self.methods, self.cache_sizes, self.compression)

    def job_config(self, documents: str | None = None) -> JobConfig:
        """The batch job that answers the sweep, every setting swept: on ``--input`` with the user's
        column flags, else on ``documents`` (the generated ones, already normalised)."""
        settings = self.compression_settings()
        fields = self.model_dump(include=set(JobConfig.model_fields) - {"compression", "sweep", "input", "columns"})
        # only the column flags given: a dump of the defaults would mark every mapping field set
        fields["columns"] = self.columns.model_dump(exclude_unset=True) if self.input is not None else {}
        source = self.input if self.input is not None else documents
        if source is None:
            raise ValueError("input: no documents (neither --input nor generated ones)")
        return JobConfig.model_validate({**fields, "input": source, "compression": settings[0], "sweep": settings})


def write_documents(config: EvalJob) -> Path:
    """The sweep's RULER documents as a Parquet file (fitted with the model's tokenizer)."""
    try:
        path, extra = resolve_model_path(config.model)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.model.trust_remote_code, **extra)
    except (ModelNotFoundError, OSError, ValueError) as exc:
        fail(f"invalid --model: {exc}")
    try:
        docs = sweep_documents(
            config.tasks,
            config.length,
            config.samples,
            token_counter(tokenizer),
            seed=config.seed,
            max_new_tokens=config.generation.max_new_tokens,
            summary_tokens=config.summary_tokens,
        )
    except ValueError as exc:
        fail(f"invalid {exc}")
    for doc in docs:
        doc.pop("metric")
    inputs = Path(tempfile.mkdtemp(prefix="criticalkv-eval-")) / "documents.parquet"
    pq.write_table(pa.Table.from_pylist(docs), inputs)
    return inputs


def _run(job) -> int | None:
    """None when the sweep ran, else its exit code (1: failed part-way; bad configuration exits 2)."""
    try:
        run_job(job, score=partial(score_answer, default_metric=job.metric))
    except JobConfigError as exc:
        fail(f"invalid {exc}")
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return None


def main(argv: list[str] | None = None) -> int:
    parser = OptionParser(EvalJob, prog="jobs/eval_compression.py", description=first_paragraph(__doc__))
    config, _ = parser.parse(argv)
    if config.report_dir is None and is_uri(config.output):
        fail("invalid --report-dir: --output is a URI; give a local directory for the report")
    try:
        job = config.job_config(None if config.input is not None else str(write_documents(config)))
    except ValueError as exc:
        fail(f"invalid {exc}")
    settings = ", ".join(f"{s.label}@{s.cache_size:g}" for s in job.sweep)
    documents = config.input if config.input is not None else f"{config.samples * len(config.tasks)} documents"
    print(f"{documents} x {len(job.sweep)} settings ({settings})")
    failed = run_interruptibly(lambda: _run(job))
    if failed is not None:
        return failed
    report = build_report([config.output], Path(config.report_dir or config.output))
    print(f"report: {report}")
    return 0
