"""Command-line options shared by ``python -m pipeline.generate`` and the jobs.

Only argument parsing and the mapping onto the pydantic configs live here; invalid values are
reported by the configs themselves, naming the field.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from .config import METHODS, CompressionConfig, GenerationConfig, ModelConfig


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="smollm2", help="smollm2 | hub id | local dir | file.gguf (default: smollm2)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--trust-remote-code", action="store_true", help="allow model repos to run their own code")
    g.add_argument("--max-context-tokens", type=int, default=None, help="default: the model's window")


def add_compression_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV-cache compression")
    g.add_argument("--method", default="none", help=f"one of: {', '.join(METHODS)}")
    g.add_argument("--cache-size", type=float, default=1.0, help="kept fraction of each context (0.2 keeps 20%%)")
    g.add_argument("--budget", type=int, default=None, help="kept tokens per KV head (overrides --cache-size)")
    add_knob_args(g)
    g.add_argument("--max-cache-tokens", type=int, default=None, help="decode-time cap per KV head")
    g.add_argument("--query-aware", action="store_true", help="compress with the question in the window")


def add_knob_args(g) -> None:
    """The method knobs shared by every setting (window, pooling, CriticalKV, AdaKV/HeadKV)."""
    g.add_argument("--window", type=int, default=32, help="SnapKV observation window")
    g.add_argument("--kernel", type=int, default=7, help="SnapKV pooling kernel (odd)")
    g.add_argument("--pooling", default="max", choices=["avg", "max"])
    g.add_argument("--first-stage-ratio", type=float, default=0.5, help="CriticalKV alpha")
    g.add_argument("--epsilon", type=float, default=1e-4, help="CriticalKV epsilon")
    g.add_argument("--norm", default="l1", choices=["l1", "l2"], help="projected value norm")
    g.add_argument("--alpha-safeguard", type=float, default=0.2, help="AdaKV/HeadKV per-head floor")
    g.add_argument("--head-priors", default=None,
                   help="HeadKV per-head importance JSON (default for smollm2: the shipped calibration)")


def add_generation_args(parser: argparse.ArgumentParser, max_new_tokens: int = 64) -> None:
    g = parser.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    g.add_argument("--batch-size", type=int, default=1, help="documents prefilled together per actor")
    g.add_argument("--truncate", default="middle", choices=["middle", "left", "error"])


def configs_from_args(args: argparse.Namespace) -> tuple[ModelConfig, CompressionConfig, GenerationConfig]:
    """Build the three configs; on a bad value print which field is wrong and exit with code 2."""
    try:
        model = ModelConfig(
            name=args.model, device=args.device, dtype=args.dtype,
            trust_remote_code=args.trust_remote_code, max_context_tokens=args.max_context_tokens,
        )
        head_priors = args.head_priors
        if head_priors is None and "headkv" in args.method.lower():
            head_priors = default_head_priors(args.model)
        compression = CompressionConfig(
            method=args.method, cache_size=args.cache_size, budget=args.budget, window=args.window,
            kernel=args.kernel, pooling=args.pooling, first_stage_ratio=args.first_stage_ratio,
            epsilon=args.epsilon, norm=args.norm, alpha_safeguard=args.alpha_safeguard,
            head_priors=head_priors, max_cache_tokens=args.max_cache_tokens, query_aware=args.query_aware,
        )
        generation = GenerationConfig(
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, truncate=args.truncate
        )
    except ValidationError as exc:
        fail(format_validation_error(exc))
    return model, compression, generation


def default_head_priors(model: str) -> str | None:
    """The HeadKV priors file shipped for a model short name (``smollm2``), if any."""
    from .eval.calibration import shipped_priors

    path = shipped_priors(model)
    return str(path) if path is not None else None


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        lines.append(f"invalid {field}: {err['msg']}")
    return "\n".join(lines)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
