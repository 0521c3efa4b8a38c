"""CLI: ``python -m pipeline.report OUT [OUT2 ...] [--output DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .build import build_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__)
    p.add_argument("inputs", nargs="+", help="job output directories (or Parquet files)")
    p.add_argument("--output", default=None, help="where report.md and PNGs go (default: the first input)")
    args = p.parse_args(argv)
    for path in args.inputs:
        if not Path(path).exists():
            print(f"error: no such output directory or file: {path}", file=sys.stderr)
            return 2
    out = Path(args.output) if args.output else Path(args.inputs[0])
    if out.is_file():
        out = out.parent
    try:
        path = build_report([Path(p) for p in args.inputs], out)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
