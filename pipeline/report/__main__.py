"""CLI: ``python -m pipeline.report OUT [OUT2 ...] [--output DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.data.locations import StorageError, is_uri

from .build import build_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__)
    p.add_argument("inputs", nargs="+", help="job output directories or Parquet files (local, or s3:// / gs:// URIs)")
    p.add_argument(
        "--output", default=None, help="local directory for report.md and PNGs (default: the first input, when local)"
    )
    args = p.parse_args(argv)
    for path in args.inputs:
        if not is_uri(path) and not Path(path).exists():
            print(f"error: no such output directory or file: {path}", file=sys.stderr)
            return 2
    if args.output is None and is_uri(args.inputs[0]):
        print("error: the first input is a URI; give --output, a local directory for the report", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else Path(args.inputs[0])
    if out.is_file():
        out = out.parent
    try:
        path = build_report(args.inputs, out)
    except (FileNotFoundError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
