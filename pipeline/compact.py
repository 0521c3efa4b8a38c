"""Merge a job output's committed files into fewer, larger ones: ``python -m pipeline.compact OUT``.

Jobs commit one file per actor batch by default (a killed driver then loses at most the batches in
flight); readers and object stores prefer few large files. Compaction, while holding the output's
lock (no job can write meanwhile):

1. removes duplicate rows (:func:`pipeline.distributed.sink.dedupe`), so a compaction that was
   interrupted part-way is finished by the next one (it is resumable);
2. groups the committed files, oldest first, until a group holds ``--rows-per-file`` rows;
3. writes each group as one new committed file (atomic, the output schema and its version metadata
   kept, the same idempotent naming as the jobs'), then deletes the group's files.

Readers never see a partial file; between steps 3's write and delete a reader may see a group's rows
twice (the next compaction or job run removes them).
"""

from __future__ import annotations

import argparse
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from .distributed import sink
from .distributed.rundir import JobConfigError, OutputDir


def compact(output: str, rows_per_file: int = 100_000) -> tuple[int, int]:
    """Compact ``output`` (a job's output directory or prefix); returns (files before, files after)."""
    out = OutputDir(output)
    manifest = out.load_manifest()
    if manifest is None:
        raise JobConfigError("output", f"{out.location} holds no manifest.json of this pipeline")
    out.lock()
    try:
        sink.dedupe(out.data_location, manifest["fingerprint"])
        files = sink.committed_files(out.data_location)
        before = len(files)
        for group in _groups(files, rows_per_file):
            tables = [pq.read_table(f.path, filesystem=f.fs) for f in group]
            merged = sink.commit_table(pa.concat_tables(tables), out.data_location, manifest["fingerprint"])
            for location in group:
                if location != merged:
                    location.delete()
        return before, len(sink.committed_files(out.data_location))
    finally:
        out.unlock()


def _groups(files: list, rows_per_file: int) -> list[list]:
    """Consecutive files, each group reaching ``rows_per_file`` rows (the last may hold fewer);
    groups of one file are left as they are."""
    groups, current, rows = [], [], 0
    for location in files:
        current.append(location)
        rows += pq.read_metadata(location.path, filesystem=location.fs).num_rows
        if rows >= rows_per_file:
            groups.append(current)
            current, rows = [], 0
    groups.append(current)
    return [g for g in groups if len(g) > 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.compact", description=__doc__.splitlines()[0])
    p.add_argument("output", help="a job's output directory or s3:// / gs:// prefix")
    p.add_argument("--rows-per-file", type=int, default=100_000, help="rows per merged file (default: 100000)")
    args = p.parse_args(argv)
    if args.rows_per_file < 1:
        print("error: invalid --rows-per-file: must be at least 1", file=sys.stderr)
        return 2
    try:
        before, after = compact(args.output, args.rows_per_file)
    except JobConfigError as exc:
        print(f"error: invalid {exc.field}: {exc.message}", file=sys.stderr)
        return 2
    print(f"{args.output}: {before} committed files -> {after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
