"""Configuration of a batch job (``jobs/longdoc_qa.py``, ``jobs/summarize.py``, ``run_job``).

A :class:`JobConfig` bundles the model, compression and generation configs with where the data
comes from, where results go and how many Ray actors run. It is validated before any actor starts;
a bad value raises a pydantic ``ValidationError`` whose location names the field
(``input``, ``output``, ``compression.method``, ``max_actors`` ...).

Input: ``input`` is a Parquet file or directory, a JSONL file, a ``save_to_disk`` directory or a hub
dataset name (see :mod:`pipeline.data.sources`), or an ``s3://`` / ``gs://`` URI of a Parquet or
JSONL object or a prefix of Parquet objects; ``None`` means the built-in sample documents of the job
(``sample_docs`` documents of about ``sample_words`` words each).

Output: ``output`` is a directory or an ``s3://`` / ``gs://`` prefix; results go to
``output/data/*.parquet`` and the run manifest to ``output/manifest.json`` (see
:mod:`pipeline.distributed.driver`). A local output must be on a filesystem the driver can see:
write tasks run on the driver's node. URIs are kept as given (canonicalised) and only parsed here,
never opened: whether the bucket exists is checked when the job starts (see :mod:`pipeline.storage`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.config import CompressionConfig, GenerationConfig, ModelConfig
from pipeline.data.normalise import ColumnMapping
from pipeline.data.sources import _looks_like_path
from pipeline.storage import StorageError, is_uri, resolve

JOBS = ("longdoc_qa", "summarize", "eval_compression")
FAULTS_ENV = "CRITICALKV_FAULTS"


class FaultConfig(BaseModel):
    """Fault injection for tests; everything is off by default and never set by the jobs' flags.

    ``raise_after_batches``: each Predictor actor raises (aborting the job, like a crash of the
    driver's pipeline) when asked for batch number N+1 (N batches succeed first), after waiting
    ``raise_delay_s`` seconds (so that the rows of the first N batches can be committed first).
    ``error_doc_ids``: documents whose generation raises inside the actor (an unexpected exception
    that the Predictor must turn into error rows).

    The jobs read these from the environment variable ``CRITICALKV_FAULTS`` (a JSON object), so a
    test can turn them on for a ``ray job submit`` run without new flags.
    """

    model_config = ConfigDict(extra="forbid")

    raise_after_batches: int | None = Field(None, ge=0)
    raise_delay_s: float = Field(0.0, ge=0.0)
    error_doc_ids: list[str] = Field(default_factory=list)
    engine: str = Field("", description="engine-level directives (pipeline.engine.faults), e.g. 'crash=ID;crash_marker=PATH'")

    @classmethod
    def from_env(cls) -> "FaultConfig":
        raw = os.environ.get(FAULTS_ENV, "").strip()
        return cls.model_validate(json.loads(raw)) if raw else cls()

    @property
    def active(self) -> bool:
        return self.raise_after_batches is not None or bool(self.error_doc_ids) or bool(self.engine)


def _parse_uri(value: str) -> str:
    """A ``file://``, ``s3://`` or ``gs://`` URI, canonicalised (offline: no bucket is contacted)."""
    try:
        location = resolve(value)
    except StorageError as exc:
        raise ValueError(str(exc)) from None
    return location.uri


class JobConfig(BaseModel):
    """One batch job (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    job: Literal["longdoc_qa", "summarize", "eval_compression"] = "longdoc_qa"
    # --- input
    input: str | None = Field(None, description="file, directory, s3:// or gs:// URI, or hub name; None: built-in samples")
    split: str | None = None
    dataset_config: str | None = None
    columns: ColumnMapping = Field(default_factory=ColumnMapping)
    instruction: str | None = Field(
        None, description="summarize: the instruction every document gets as its only question"
    )
    sample_docs: int = Field(3, ge=1, description="built-in samples: number of documents")
    sample_words: int = Field(800, ge=50, description="built-in samples: words per document")
    sample_seed: int = 0
    normalise: Literal["auto", "driver", "ray"] = Field(
        "auto", description="where input rows are grouped into documents (see pipeline.distributed.driver)"
    )
    # --- output
    output: str = Field(description="directory, or s3:// / gs:// prefix")
    rows_per_file: int = Field(64, ge=1, description="rows bundled per committed Parquet file")
    retry_errors: bool = Field(False, description="resume also re-runs questions whose row has an error")
    # --- what runs
    model: ModelConfig = Field(default_factory=ModelConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    sweep: list[CompressionConfig] = Field(
        default_factory=list,
        description="eval_compression: settings answered from one prefill per document; question ids "
        "of a sweep are '<question>|<method>|<cache_size>' (see pipeline.eval.sweep)",
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    engine_factory: str | None = Field(
        None, description="'module:function' building the Engine from the three configs (tests)"
    )
    # --- where it runs
    ray_address: str | None = Field(None, description="default: $RAY_ADDRESS, else a local Ray started here")
    min_actors: int = Field(1, ge=1)
    max_actors: int = Field(1, ge=1)
    gpus_per_actor: float = Field(0.0, ge=0.0)
    cpus_per_actor: float | None = Field(None, gt=0.0, description="default: 1 with GPUs, else 2 (or all CPUs if fewer)")
    faults: FaultConfig = Field(default_factory=FaultConfig)
    oom_retry_cache_size: float | None = Field(
        None, gt=0.0, le=1.0, description="retry a document that ran out of memory once at this cache size"
    )

    @field_validator("input")
    @classmethod
    def _input_exists(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("input must not be empty (leave it unset for the built-in samples)")
        if is_uri(value):
            return _parse_uri(value)
        path = Path(value).expanduser()
        if not path.exists() and _looks_like_path(value):
            raise ValueError(f"no such file or directory: {value}")
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
    def _consistent(self) -> "JobConfig":
        if self.min_actors > self.max_actors:
            raise ValueError(f"min_actors ({self.min_actors}) must not exceed max_actors ({self.max_actors})")
        if self.job == "summarize" and self.instruction is not None and not self.instruction.strip():
            raise ValueError("instruction must not be empty")
        return self

    # ------------------------------------------------------------------ derived
    @property
    def batch_size(self) -> int:
        """Documents per actor call; equal to the engine's prefill batch (one call = one batch)."""
        return self.generation.batch_size

    def resolved_cpus_per_actor(self, cluster_cpus: float | None = None) -> float:
        if self.cpus_per_actor is not None:
            return self.cpus_per_actor
        if self.gpus_per_actor > 0:
            return 1.0
        return float(max(1, min(2, int(cluster_cpus or 2))))

    def identity(self) -> dict:
        """The settings that decide what a result row means; a resumed run must match them.

        Resources, batching, fault injection and input location may change between runs into
        the same output directory; the model, method, budgets, decoding limits and prompts may not.
        """
        return {
            "job": self.job,
            "instruction": self.instruction,
            "engine_factory": self.engine_factory,
            "model": self.model.model_dump(mode="json", exclude={"cache_dir"}),
            "compression": self.compression.model_dump(mode="json"),
            "sweep": [c.model_dump(mode="json") for c in self.sweep],
            "generation": self.generation.model_dump(mode="json", exclude={"batch_size"}),
        }

    def fingerprint(self) -> str:
        text = json.dumps(self.identity(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


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
