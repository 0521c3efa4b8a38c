"""Configuration of the engine room: which model runs where (:class:`ModelConfig`) and how it decodes
(:class:`GenerationConfig`). Bad values fail at construction with a pydantic ``ValidationError``
naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..options import CommandLineConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """Model (which model to load and where it runs).

    ``name``: ``smollm2`` (bundled SmolLM2-135M-Instruct GGUF), a Hugging Face Hub id or an ``s3://`` /
    ``gs://`` model directory (both fetched once per node where the model runs), a local directory with
    safetensors weights, or a ``.gguf`` file. ``device``/``dtype`` ``auto`` picks CUDA + bfloat16
    when a GPU is visible, otherwise CPU + float32.
    """

    name: str = Field(
        "smollm2",
        description="smollm2 (bundled 135M demo model), a Hugging Face Hub id (downloaded where the actors run; "
        "HF_TOKEN from the environment), an s3:// or gs:// model directory, a local safetensors directory, or a "
        ".gguf file",
        json_schema_extra={"flag": "model"},
    )
    revision: str | None = Field(
        None,
        description="Hub model only: the branch, tag or commit to load (default: main, resolved to its commit "
        "once before the actors start, so that every actor loads the same weights)",
        json_schema_extra={"flag": "model-revision"},
    )
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (auto: CUDA when visible)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)"
    )
    trust_remote_code: bool = Field(False, description="allow model repositories to run their own code")
    cache_dir: Path | None = Field(
        None,
        description="where converted GGUF models and s3:// / gs:// model copies are kept (default: "
        "$CRITICALKV_CACHE_DIR or ~/.cache/criticalkv-pipeline)",
    )
    weight_layout: Literal["auto", "row", "column"] = Field(
        "auto",
        description="memory order of the linear layers' weights: column (the transpose stored "
        "contiguously) makes one-token decode matmuls faster on CPU, same values; auto: column on "
        "CPU, row (as loaded) on CUDA",
    )
    feed_forward_chunk: int = Field(
        512,
        ge=0,
        description="tokens per slice of the MLP blocks in a long forward: same values, the MLP's "
        "intermediate activations held for one slice instead of the whole context (0: whole)",
    )
    layerwise_prefill: int | None = Field(
        None,
        ge=0,
        description="tokens per slice of a layer-by-layer context prefill: each layer runs over the whole "
        "context a slice at a time before the next layer, and methods that decide per layer compress it "
        "at once, so the prefill holds one slice's activations and one layer's dense K/V besides the "
        "cache; the same kept entries as one forward, values equal up to float rounding (0: one forward; "
        "Llama, Mistral and Qwen2/3 models)",
        # docs/BENCHMARKS.md, "Layer-by-layer prefill": on CPU 1024-token slices take the one-pass
        # default's peak from 0.57x to 0.39-0.41x of the full cache for 1.05-1.11x the prefill time;
        # not measured on a GPU, so one forward there until it is
        json_schema_extra={"shown_default": "auto: 1024 on CPU where the model allows it, else 0"},
    )
    max_context_tokens: int | None = Field(
        None, ge=16, description="context window; longer contexts are cut (default: the model's window)"
    )

    @field_validator("name")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model name must not be empty")
        return value.strip()


GENERATION_HELP_ORDER = (
    "max_new_tokens",
    "batch_size",
    "settings_per_decode",
    "continuous",
    "kv_memory",
    "decode_between_prefills",
)


class _GenerationOptions(_Strict, CommandLineConfig):
    """Generation (greedy decoding, stopping at EOS or after max_new_tokens)."""

    @classmethod
    def option_groups(cls) -> list[tuple[str, list[str]]]:
        first = [name for name in GENERATION_HELP_ORDER if name in cls.model_fields]
        rest = [name for name in cls.model_fields if name not in first]
        return [(_GenerationOptions.__doc__.strip().rstrip("."), first + rest)]


class DecodingConfig(_GenerationOptions):
    """Generation (greedy decoding, stopping at EOS or after max_new_tokens): what every job decodes with."""

    max_new_tokens: int = Field(64, ge=1, le=8192, description="generated tokens per answer at most")
    batch_size: int | None = Field(
        None,
        ge=1,
        description="documents per actor call: decoded as one continuous batch (--no-continuous: prefilled "
        "together, left padded)",
        json_schema_extra={
            "shown_default": "auto: 8, fewer when the input would leave actors idle (documents / max actors); "
            "1 for sweeps"
        },
    )
    end_at_sentence: bool = Field(
        False, description="an answer cut by max_new_tokens ends at its last complete sentence (summaries)"
    )
    truncate: Literal["middle", "left", "error"] = Field(
        "middle",
        description="a context longer than the window: cut its middle (as LongBench), its start, or fail the row",
    )


class ContinuousBatching(_Strict):
    """The batch jobs' decode batch: continuous, within a KV memory."""

    continuous: bool = Field(
        True,
        description="the documents of an actor call are prefilled one by one and decoded together while their "
        "caches fit --kv-memory, rows leaving as their answers end and waiting documents joining as memory frees; "
        "off: prefilled together (left padded), then decoded in the same loop (as sweeps are)",
    )
    # docs/BENCHMARKS.md, "Documents committed as they finish": 0.25 ends (and commits) a call's first
    # document early for 7-8 % more call time on CPU (issue #50: a crash loses only unfinished documents,
    # and a job's first file comes long before its last); 0.5 spreads the ends over the call for 12-15 %
    decode_between_prefills: float = Field(
        0.25,
        ge=0,
        le=100,
        description="while documents of a call wait to be prefilled, the rows already decoding take decode "
        "steps for this many times the last document's prefill time before the next prefill (0: every "
        "waiting document that fits is prefilled first, the fullest decode batch; higher: the first answers "
        "end, and are committed, sooner, at the cost of decode steps with fewer rows)",
    )
    kv_memory: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="MiB of KV cache per actor for the continuous batch",
        json_schema_extra={
            "shown_default": "70 % of the GPU memory free once the model is loaded; on CPU 25 % of the RAM "
            "available then"
        },
    )


class SweepDecoding(_Strict):
    """A sweep's decode: its settings decoded side by side."""

    settings_per_decode: int = Field(
        8,
        ge=1,
        description="sweeps: compressed settings of one batch decoded together as one batch "
        "(1: each alone, with its own decode times)",
    )


class BatchGeneration(DecodingConfig, ContinuousBatching):
    """Generation (greedy decoding, stopping at EOS or after max_new_tokens): the batch jobs' options."""


class SweepGeneration(DecodingConfig, SweepDecoding):
    """Generation (greedy decoding, stopping at EOS or after max_new_tokens): a sweep's options (its
    settings always decode on the batch path)."""


class GenerationConfig(DecodingConfig, ContinuousBatching, SweepDecoding):
    """Generation (greedy decoding, stopping at EOS or after max_new_tokens): the engine's, every option.

    The jobs take the part that applies to them (:class:`BatchGeneration`, :class:`SweepGeneration`);
    :meth:`of` completes one with the defaults of the rest.
    """

    @classmethod
    def of(cls, options: BaseModel | None) -> GenerationConfig:
        """The engine's config from a job's generation options (None: every default)."""
        if options is None:
            return cls()
        if isinstance(options, GenerationConfig):
            return options
        return cls.model_validate(options.model_dump())
