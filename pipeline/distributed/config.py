"""Configuration of a batch job: :class:`JobConfig` and the two headline jobs' own defaults.

A :class:`JobConfig` bundles the model, compression and generation configs with where the data
comes from, where results go and how many Ray actors run. It is validated before any actor starts;
a bad value raises a pydantic ``ValidationError`` whose location names the field
(``input``, ``output``, ``compression.cache_size``, ``max_actors`` ...). The jobs' command lines are
generated from these fields (:mod:`pipeline.options`); :class:`LongDocQAJob` and
:class:`SummarizeJob` hold the defaults that differ between the jobs.

Input: ``input`` is a Parquet file or directory, a JSONL file, a ``save_to_disk`` directory or a hub
dataset name (see :mod:`pipeline.data.sources`), or an ``s3://`` / ``gs://`` URI of a Parquet or
JSONL object or a prefix of Parquet objects; ``None`` means the built-in sample documents of the job.

Output: ``output`` is a directory or an ``s3://`` / ``gs://`` prefix; results go to
``output/data/*.parquet`` and the run manifest to ``output/manifest.json`` (see
:mod:`pipeline.distributed.driver`). URIs are canonicalised here and never opened: whether the bucket
exists is checked when the job starts.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.data.locations import StorageError, is_uri, resolve
from pipeline.data.normalise import ColumnMapping, DocumentColumns
from pipeline.data.sources import looks_like_path
from pipeline.data.synthetic import SUMMARY_INSTRUCTION
from pipeline.engine.config import BatchGeneration, GenerationConfig, ModelConfig
from pipeline.engine.kvzap_file import resolve_kvzap
from pipeline.engine.loading import model_may_exist
from pipeline.engine.priors import resolve_head_priors
from pipeline.kv.config import CompressionConfig, default_compression
from pipeline.options import CommandLineConfig

JOBS = ("longdoc_qa", "summarize", "eval_compression")
HIDDEN = {"cli": False}


def _parse_uri(value: str) -> str:
    """A ``file://``, ``s3://`` or ``gs://`` URI, canonicalised (offline: no bucket is contacted)."""
    try:
        location = resolve(value)
    except StorageError as exc:
        raise ValueError(str(exc)) from None
    return location.uri


def default_output(job: str) -> str:
    return str(Path("outputs") / f"{job}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")


# model options that change how the same values are computed, not what a row means
_EXECUTION_ONLY_MODEL_FIELDS = {"cache_dir", "weight_layout", "feed_forward_chunk", "layerwise_prefill"}


class BuiltInSamples(BaseModel):
    """The built-in sample documents a job answers when it is given no input (``make run``)."""

    sample_docs: int = Field(3, ge=1, description="built-in samples: number of documents")
    sample_words: int = Field(800, ge=50, description="built-in samples: words per document")
    sample_seed: int = Field(0, description="built-in samples: random seed")


class JobConfig(CommandLineConfig):
    """Input and output"""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # documents per actor call without --batch-size: enough rows for the continuous decode batch to
    # decode several documents at once (docs/BENCHMARKS.md measures it), few enough to commit often
    auto_batch_size: ClassVar[int] = 8

    job: Literal["longdoc_qa", "summarize", "eval_compression"] = Field("longdoc_qa", json_schema_extra=HIDDEN)
    # --- input
    input: str | None = Field(
        None,
        description="Parquet file/dir, JSONL, save_to_disk dir, hub dataset, or an "
        "s3:// / gs:// URI of Parquet or JSONL (default: built-in sample documents)",
    )
    split: str | None = Field(None, description="split of a datasets directory or hub dataset")
    dataset_config: str | None = Field(None, description="hub dataset configuration name")
    columns: ColumnMapping = Field(default_factory=ColumnMapping)
    ignore_unknown_files: bool = Field(
        False,
        description="skip (with a warning) files of an input directory that are neither Parquet nor JSON "
        "lines, instead of refusing the directory",
    )
    instruction: str | None = Field(
        None,
        description="one question (or instruction) every document gets instead of its own questions; "
        "summaries: the summary instruction",
    )
    normalise: Literal["auto", "driver", "ray"] = Field(
        "auto",
        description="where input rows are grouped into documents: on the driver, or in Ray tasks "
        "(auto: Ray for Parquet inputs over 256 MiB)",
    )
    # --- output
    output: str = Field(
        description="output directory or s3:// / gs:// prefix; rerun into it to resume",
        json_schema_extra={"shown_default": "a new outputs/<job>-<timestamp>/"},
    )
    rows_per_file: int | None = Field(
        None,
        ge=1,
        description="commit files of at least this many rows (default: one file per document as soon as it is "
        "answered, so a killed driver loses only the documents not finished; more rows per file = fewer, larger "
        "files, more work lost on a crash; python -m pipeline.compact OUT merges them later)",
    )
    retry_errors: bool = Field(False, description="on resume, also redo questions whose row has an error")
    metric: str = Field(
        "string_match_all",
        description="scores rows that have a reference and name no known task (RULER string_match_all, "
        "string_match_part; LongBench qa_f1, rouge_l, classification_score, retrieval_score, count_score, "
        "code_sim_score)",
    )
    max_error_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="exit with code 3 when more than this fraction of the output's rows carry "
        "an error (default 0: any error row)",
    )
    # --- what runs
    model: ModelConfig = Field(default_factory=ModelConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    sweep: list[CompressionConfig] = Field(
        default_factory=list,
        json_schema_extra=HIDDEN,
        description="settings answered from one prefill per document (eval_compression); each answer's row key "
        "is its question id qualified by the setting (pipeline.engine.types.Setting)",
    )
    # every engine option; each job declares only the part that applies to it (BatchGeneration, SweepGeneration)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    engine_factory: str | None = Field(
        None,
        description="'package.module:function' building the engine from "
        "(model, compression, generation) configs: custom models, tests",
    )
    # --- where it runs
    ray_address: str | None = Field(
        None, description="Ray cluster to use (default: $RAY_ADDRESS, else a local Ray started by the job)"
    )
    num_actors: int | None = Field(
        None, ge=1, description="fixed actor pool size (sets min and max actors, over any value they were given)"
    )
    min_actors: int = Field(1, ge=1, description="smallest actor pool (autoscaling between min and max)")
    max_actors: int = Field(1, ge=1, description="largest actor pool")
    gpus_per_actor: float = Field(0.0, ge=0.0, description="GPUs per actor")
    cpus_per_actor: float | None = Field(
        None, gt=0.0, description="CPUs per actor (default: 1 with GPUs, else 2 or all CPUs if fewer)"
    )
    oom_retry_cache_size: float | None = Field(
        None, gt=0.0, le=1.0, description="retry a document that ran out of memory once, at this smaller cache size"
    )
    stall_timeout_s: float | None = Field(
        None,
        gt=0.0,
        description="fail the run when no actor batch finishes for this many seconds (default: no limit; "
        "Ray Data's own 30-minute limit is lifted, since one long document or a large sweep may take longer)",
    )

    @classmethod
    def option_groups(cls) -> list[tuple[str, list[str]]]:
        """Command-line help layout (:mod:`pipeline.options`)."""
        ray = [
            "ray_address",
            "num_actors",
            "min_actors",
            "max_actors",
            "gpus_per_actor",
            "cpus_per_actor",
            "oom_retry_cache_size",
            "stall_timeout_s",
            "engine_factory",
        ]
        configs = ["columns", "model", "compression", "generation"]
        samples = [n for n in BuiltInSamples.model_fields if n in cls.model_fields]
        io = [n for n in cls.model_fields if n not in ray + configs + samples]
        if samples:  # right after the input they stand in for
            io[io.index("normalise") : io.index("normalise")] = samples
        return [("input and output", io), ("Ray resources", ray), ("", configs)]

    @model_validator(mode="before")
    @classmethod
    def _defaults_that_depend_on_others(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if not data.get("output"):
            data["output"] = default_output(data.get("job") or cls.model_fields["job"].default)
        fixed = data.get("num_actors")
        # a fixed pool wins over min/max actors; an invalid one is reported under its own name only
        if isinstance(fixed, int) and not isinstance(fixed, bool) and fixed >= 1:
            data["min_actors"] = data["max_actors"] = fixed
        return data

    @field_validator("input")
    @classmethod
    def _input_exists(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("input must not be empty (leave it unset for the built-in samples)")
        if is_uri(value):
            return _parse_uri(value)
        if not Path(value).expanduser().exists() and looks_like_path(value):
            raise ValueError(f"no such file or directory: {value}")
        return value

    @field_validator("instruction")
    @classmethod
    def _instruction_text(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("instruction must not be empty")
        return value

    @field_validator("output", mode="before")
    @classmethod
    def _output_text(cls, value: object) -> object:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("output")
    @classmethod
    def _output_is_dir(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("output must not be empty")
        if is_uri(value):
            return _parse_uri(value)
        path = Path(value).expanduser()
        if path.exists() and not path.is_dir():
            raise ValueError(f"{value} exists and is a file; the output must be a directory")
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ValueError(f"{parent} is a file, so {value} cannot be created")
        return value

    @field_validator("engine_factory")
    @classmethod
    def _factory_path(cls, value: str | None) -> str | None:
        if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
            raise ValueError(f"expected 'package.module:function', got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        if self.min_actors > self.max_actors:
            raise ValueError(f"min_actors ({self.min_actors}) must not exceed max_actors ({self.max_actors})")
        retry, size = self.oom_retry_cache_size, getattr(self.compression, "cache_size", None)  # sweeps: per setting
        if retry is not None and size is not None and self.compression.compresses and retry >= size:
            raise ValueError(
                f"oom_retry_cache_size ({retry:g}) must be below the cache size ({size:g}): the retry is meant to "
                "keep less than the first try"
            )
        for setting in self.compression_settings():
            resolve_head_priors(setting, self.model.name)  # a headkv method needs a priors file: fail now
            if model_may_exist(self.model.name):  # else the model check names the real problem
                self._check_kvzap(setting)
        return self

    def _check_kvzap(self, setting: CompressionConfig) -> None:
        """kvzap / shares need a KVzap file for the model: a named file that is wrong fails now; a missing
        one fails now unless the job calibrates one first (``calibrate`` auto)."""
        try:
            resolve_kvzap(setting, self.model.name)
        except ValueError:
            if setting.kvzap_model is not None or getattr(self, "calibrate", "off") != "auto":
                raise

    # ------------------------------------------------------------------ derived
    def compression_settings(self) -> list[CompressionConfig]:
        """Every compression this job runs (checked for the files they need before Ray starts)."""
        return [self.compression, *self.sweep]

    def batch_size_for(self, documents: int | None) -> int:
        """Documents per actor call (one call = one continuous decode batch, or one prefill batch):
        ``--batch-size``, else :attr:`auto_batch_size`, lowered to spread ``documents`` (None: not known
        before the run) over ``max_actors`` so that no actor idles for want of a call."""
        if self.generation.batch_size is not None:
            return self.generation.batch_size
        if documents is None:
            return self.auto_batch_size
        return max(1, min(self.auto_batch_size, math.ceil(documents / self.max_actors)))

    def resolved_cpus_per_actor(self, cluster_cpus: float | None = None) -> float:
        if self.cpus_per_actor is not None:
            return self.cpus_per_actor
        if self.gpus_per_actor > 0:
            return 1.0
        return float(max(1, min(2, int(cluster_cpus or 2))))

    def identity(self) -> dict:
        """The settings that decide what a result row means; a resumed run must match them.

        Resources, batching, the weights' memory order, the MLP's and the layerwise prefill's slicing (the same
        kept entries, values equal up to float rounding) and input location may change between runs
        into the same output directory; the model, method, budgets, decoding limits and prompts may not.
        """
        return {
            "job": self.job,
            "instruction": self.instruction,
            "engine_factory": self.engine_factory,
            "model": self.model.model_dump(mode="json", exclude=_EXECUTION_ONLY_MODEL_FIELDS),
            "compression": self.compression.model_dump(mode="json"),
            "sweep": [c.model_dump(mode="json") for c in self.sweep],
            "generation": self.generation.model_dump(
                mode="json",
                exclude={"batch_size", "settings_per_decode", "continuous", "kv_memory", "decode_between_prefills"},
            ),
        }

    def fingerprint(self) -> str:
        text = json.dumps(self.identity(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class SelfCalibration(BaseModel):
    """The learned scorer's calibration for a model without one (pipeline.apps.self_calibration)."""

    calibrate: Literal["auto", "off"] = Field(
        "auto",
        description="methods with the learned scorer (kvzap, shares) on a model with no KVzap file: auto calibrates "
        "it first on --calibration-docs of this job's documents (reused by reruns into the same output); off refuses",
    )
    calibration_docs: int = Field(8, ge=2, description="documents of the input the calibration samples")


class LongDocQAJob(BuiltInSamples, SelfCalibration, JobConfig):
    """Input and output"""

    job: Literal["longdoc_qa"] = Field("longdoc_qa", json_schema_extra=HIDDEN)
    compression: CompressionConfig = Field(default_factory=default_compression)
    generation: BatchGeneration = Field(default_factory=lambda: BatchGeneration(max_new_tokens=24))


class SummarizeJob(BuiltInSamples, SelfCalibration, JobConfig):
    """Input and output"""

    job: Literal["summarize"] = Field("summarize", json_schema_extra=HIDDEN)
    instruction: str = Field(
        SUMMARY_INSTRUCTION, description="the instruction every document gets as its only question"
    )
    columns: DocumentColumns = Field(default_factory=DocumentColumns)
    metric: str = Field("rouge_l", description="scores summaries against a reference column, when there is one")
    sample_docs: int = Field(2, ge=1, description="built-in samples: number of documents")
    sample_words: int = Field(400, ge=50, description="built-in samples: words per document")
    compression: CompressionConfig = Field(default_factory=default_compression)
    generation: BatchGeneration = Field(
        default_factory=lambda: BatchGeneration(max_new_tokens=256, end_at_sentence=True)
    )


JOB_CONFIGS: dict[str, type[JobConfig]] = {"longdoc_qa": LongDocQAJob, "summarize": SummarizeJob}


def identity_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two :meth:`JobConfig.identity` dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += identity_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out
