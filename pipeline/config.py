"""Configuration models shared by the library, the jobs and the CLI.

Every knob of the compression method lives in :class:`CompressionConfig`; a bad value fails at
construction time with a pydantic ``ValidationError`` whose message names the field.

Method names (``CompressionConfig.method``):

=============================  ======================================================================
``none``                       full cache (still held in the variable-length cache, nothing evicted)
``streamingllm``               attention sinks + most recent tokens (StreamingLLM, arXiv 2309.17453)
``snapkv``                     SnapKV observation-window scores, uniform budget (arXiv 2404.14469)
``adakv-snapkv``               SnapKV scores, AdaKV adaptive per-head budgets (arXiv 2407.11550)
``headkv-snapkv``              SnapKV scores, HeadKV static per-head budgets (arXiv 2410.19258)
``criticalkv-snapkv``          CriticalKV two-stage selection on SnapKV (arXiv 2502.03805)
``criticalkv-adakv-snapkv``    CriticalKV on AdaKV budgets
``criticalkv-headkv-snapkv``   CriticalKV on HeadKV budgets
=============================  ======================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

METHODS: tuple[str, ...] = (
    "none",
    "streamingllm",
    "snapkv",
    "adakv-snapkv",
    "headkv-snapkv",
    "criticalkv-snapkv",
    "criticalkv-adakv-snapkv",
    "criticalkv-headkv-snapkv",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CompressionConfig(_Strict):
    """How the context's KV cache is compressed (see DESIGN.md, "The method").

    Budgets: ``cache_size`` is the kept fraction of each row's own context length (0.2 keeps 20 %,
    as the paper's "cache size"); ``budget`` (tokens per KV head) overrides it when given. The
    observation window sits inside the budget; when a row is so short that its budget is smaller than
    the window, the window shrinks to the budget for that row.
    """

    method: str = "none"
    cache_size: float = Field(1.0, gt=0.0, le=1.0)
    budget: int | None = Field(None, ge=1)
    # SnapKV scorer
    window: int = Field(32, ge=1, description="observation window (last context tokens)")
    kernel: int = Field(7, ge=1, description="1-D pooling kernel over key positions (odd)")
    pooling: Literal["avg", "max"] = "max"
    # CriticalKV
    first_stage_ratio: float = Field(0.5, ge=0.0, le=1.0)
    epsilon: float = Field(1e-4, ge=0.0)
    norm: Literal["l1", "l2"] = "l1"
    # AdaKV / HeadKV
    alpha_safeguard: float = Field(0.2, ge=0.0, le=1.0)
    head_priors: Path | None = Field(None, description="HeadKV per-head importance JSON file")
    # StreamingLLM
    sink_tokens: int = Field(4, ge=0)
    # decode-time cap: evict lowest accumulated-attention x projected-norm entry per head
    max_cache_tokens: int | None = Field(None, ge=1)
    # question inside the observation window (prefilled with the context) instead of after it
    query_aware: bool = False

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        value = value.strip().lower()
        if value not in METHODS:
            raise ValueError(f"unknown method {value!r}; choose one of {', '.join(METHODS)}")
        return value

    @field_validator("kernel")
    @classmethod
    def _odd_kernel(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError(f"kernel must be odd so pooling keeps positions aligned, got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "CompressionConfig":
        if self.budget is not None and self.method not in ("none",) and self.budget < self.window:
            raise ValueError(
                f"budget ({self.budget} tokens per head) is smaller than the observation window "
                f"({self.window}); the window is always kept and counts inside the budget"
            )
        if self.uses_headkv and self.head_priors is None:
            raise ValueError(f"head_priors: method {self.method!r} needs a HeadKV priors JSON file")
        if self.head_priors is not None and not Path(self.head_priors).is_file():
            raise ValueError(f"head_priors: file not found: {self.head_priors}")
        if self.max_cache_tokens is not None and self.max_cache_tokens <= self.window:
            raise ValueError(
                f"max_cache_tokens ({self.max_cache_tokens}) must exceed the window ({self.window}),"
                " which is never evicted"
            )
        return self

    # --- derived views used by pipeline.kv --------------------------------------------------
    @property
    def compresses(self) -> bool:
        return self.method != "none" and (self.cache_size < 1.0 or self.budget is not None)

    @property
    def uses_criticalkv(self) -> bool:
        return self.method.startswith("criticalkv-")

    @property
    def uses_adakv(self) -> bool:
        return "adakv" in self.method

    @property
    def uses_headkv(self) -> bool:
        return "headkv" in self.method

    @property
    def scorer(self) -> str:
        if self.method == "none":
            return "none"
        return "streamingllm" if self.method == "streamingllm" else "snapkv"


class ModelConfig(_Strict):
    """Which model to load and where it runs.

    ``name``: ``smollm2`` (bundled SmolLM2-135M-Instruct GGUF), a hub id, a local directory with
    safetensors weights, or a ``.gguf`` file. ``device``/``dtype`` ``auto`` picks CUDA + bfloat16
    when a GPU is visible, otherwise CPU + float32.
    """

    name: str = "smollm2"
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False
    cache_dir: Path | None = Field(None, description="where converted GGUF models are kept")
    max_context_tokens: int | None = Field(None, ge=16, description="default: the model's window")

    @field_validator("name")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model name must not be empty")
        return value.strip()


class GenerationConfig(_Strict):
    """Decoding settings: greedy, stopping at EOS or after ``max_new_tokens``."""

    max_new_tokens: int = Field(64, ge=1, le=8192)
    batch_size: int = Field(1, ge=1, description="documents prefilled together (left padded)")
    truncate: Literal["middle", "left", "error"] = "middle"
