"""Answer questions about one document: ``python -m pipeline.generate --context-file doc.txt --question ...``

Prints the answer and its metrics (``--json``: one JSON object per question with the output
contract's keys). Meant for trying methods and settings by hand; batch work goes through the jobs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli_args import add_compression_args, add_generation_args, add_model_args, configs_from_args, fail
from .engine.engine import Engine
from .engine.loading import ModelNotFoundError
from .engine.types import Request


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.generate", description=__doc__.splitlines()[0])
    p.add_argument("--context-file", required=True, help="text file with the long document ('-' = stdin)")
    p.add_argument("--question", action="append", required=True, help="question (repeat for several)")
    p.add_argument("--answer-prefix", default="", help="text the answer starts with")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    add_model_args(p)
    add_compression_args(p)
    add_generation_args(p, max_new_tokens=64)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_cfg, compression, generation = configs_from_args(args)
    if args.context_file == "-":
        context = sys.stdin.read()
    else:
        path = Path(args.context_file)
        if not path.is_file():
            fail(f"--context-file: no such file: {path}")
        context = path.read_text(encoding="utf-8", errors="replace")
    try:
        engine = Engine.from_config(model_cfg, compression, generation)
    except (ModelNotFoundError, ValueError) as exc:
        fail(f"--model: {exc}")
    request = Request(doc_id=Path(args.context_file).name, context=context, questions=args.question, answer_prefix=args.answer_prefix)
    status = 0
    for answer in engine.generate([request]):
        row = {"model": model_cfg.name, "method": compression.method, "cache_size": compression.cache_size,
               "budget": compression.budget, **answer.as_row()}
        status = status or (1 if answer.error else 0)
        if args.json:
            print(json.dumps(row))
            continue
        if answer.error:
            print(f"[{answer.question_id}] error: {answer.error}")
            continue
        print(f"[{answer.question_id}] {args.answer_prefix}{answer.prediction}")
        kept = answer.kv_bytes_kept / answer.kv_bytes_full if answer.kv_bytes_full else float("nan")
        print(
            f"    context {answer.context_tokens} tok | question {answer.question_tokens} | generated "
            f"{answer.generated_tokens} | KV kept {answer.kv_entries_kept}/{answer.kv_entries_full} entries, "
            f"{kept:.1%} of full bytes | ttft {answer.ttft_s:.2f}s (compress {answer.compress_s:.3f}s) | "
            f"decode {answer.decode_ms_per_token or 0:.1f} ms/tok | peak mem {answer.peak_memory_bytes / 2**20:.0f} MiB | {answer.device}"
        )
    return status


if __name__ == "__main__":
    raise SystemExit(main())
