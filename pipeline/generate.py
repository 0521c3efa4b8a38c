"""Answer questions about one document: ``python -m pipeline.generate --context-file doc.txt --question ...``

Prints the answer and its metrics (``--json``: one JSON object per question with the output
contract's keys). Meant for trying methods and settings by hand; batch work goes through the jobs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from .engine.config import GenerationConfig, ModelConfig
from .engine.engine import Engine
from .engine.loading import ModelNotFoundError
from .engine.types import Answer, Request
from .kv.config import CompressionConfig, default_compression
from .options import OptionParser, fail


class GenerateRun(BaseModel):
    """Document"""

    model_config = ConfigDict(extra="forbid")

    context_file: str = Field(description="text file with the long document ('-' = stdin)")
    question: list[str] = Field(
        description="question (repeat the flag for several)", json_schema_extra={"repeat": True}
    )
    answer_prefix: str = Field("", description="text the answer starts with")
    model: ModelConfig = Field(default_factory=ModelConfig)
    compression: CompressionConfig = Field(default_factory=default_compression)  # the jobs' default too
    generation: GenerationConfig = Field(default_factory=GenerationConfig)


def build_parser() -> OptionParser:
    def output_format(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON lines instead of text")

    return OptionParser(
        GenerateRun, prog="python -m pipeline.generate", description=__doc__.splitlines()[0], extra_args=output_format
    )


def _read_context(name: str) -> str:
    if name == "-":
        return sys.stdin.read()
    path = Path(name)
    if not path.exists():  # a pipe (``<(cmd)``, /dev/fd/N) is no regular file but reads as one
        fail(f"invalid --context-file: no such file: {path}")
    if path.is_dir():
        fail(f"invalid --context-file: {path} is a directory, not a text file")
    return path.read_text(encoding="utf-8", errors="replace")


def _describe(answer: Answer, prefix: str) -> str:
    if answer.error:
        return f"[{answer.question_id}] error: {answer.error}"
    kept = answer.kv_bytes_kept / answer.kv_bytes_full if answer.kv_bytes_full else float("nan")
    return (
        f"[{answer.question_id}] {prefix}{answer.prediction}\n"
        f"    context {answer.context_tokens} tok | question {answer.question_tokens} | generated "
        f"{answer.generated_tokens} | KV kept {answer.kv_entries_kept}/{answer.kv_entries_full} entries, "
        f"{kept:.1%} of full bytes | ttft {answer.ttft_s:.2f}s (compress {answer.compress_s:.3f}s) | decode "
        f"{answer.decode_ms_per_token or 0:.1f} ms/tok | peak mem {(answer.peak_memory_bytes or 0) / 2**20:.0f} MiB | "
        f"{answer.device}"
    )


def main(argv: list[str] | None = None) -> int:
    run, args = build_parser().parse(argv)
    context = _read_context(run.context_file)
    try:
        engine = Engine.from_config(run.model, run.compression, run.generation)
    except ModelNotFoundError as exc:
        fail(f"invalid --model: {exc}")
    except ValueError as exc:
        fail(f"invalid {exc}")
    request = Request(
        doc_id=Path(run.context_file).name, context=context, questions=run.question, answer_prefix=run.answer_prefix
    )
    status = 0
    for answer in engine.generate([request]):
        status = status or (1 if answer.error else 0)
        if args.json:
            row = {
                "model": run.model.name,
                "method": run.compression.method,
                "cache_size": run.compression.cache_size,
                "budget": run.compression.budget,
                **answer.as_row(),
            }
            print(json.dumps(row))
        else:
            print(_describe(answer, run.answer_prefix))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
