"""Aggregations of the jobs' Parquet outputs (output contract rows) into report tables.

Inputs are pyarrow tables with the output schema (``pipeline.data.schema``); aggregation is plain
Python over columns so that the report has no pandas dependency. Every table is a list of dict
rows plus the column order, rendered to Markdown by :func:`markdown`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.locations import Location, resolve
from pipeline.data.sources import parquet_files

FULL = "none"


def result_files(path: str | Path) -> list[Location]:
    """The result Parquet files of a job output directory (its ``data/`` folder), a folder of
    Parquet files or one file; local paths or ``s3://`` / ``gs://`` URIs (:mod:`pipeline.data.locations`)."""
    location = resolve(path)
    if location.is_file():
        return [location] if location.suffix == ".parquet" else []
    data = location.child("data")
    root = data if data.is_dir() else location
    files = [root.at(i) for i in parquet_files(root)]
    return [f for f in files if f.suffix == ".parquet" and f.name != "perturbation.parquet"]


def read_outputs(paths: list[str | Path]) -> pa.Table:
    """All result rows under the given output directories (their ``data/`` folders) or files."""
    tables = []
    for path in paths:
        files = result_files(path)
        if not files:
            raise FileNotFoundError(f"no result Parquet files under {path}")
        tables += [pq.read_table(f.path, filesystem=f.fs) for f in files]
    return pa.concat_tables(tables, promote_options="default")


def _rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _setting(row: dict) -> tuple[str, float]:
    size = row.get("cache_size")
    return row.get("method") or FULL, 1.0 if size is None else float(size)


def overview(table: pa.Table) -> list[dict]:
    """Rows ok / failed per job and method."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in _rows(table):
        groups[(row.get("job"), row.get("model"), row.get("method"))].append(row)
    out = []
    for (job, model, method), rows in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        failed = [r for r in rows if r.get("error")]
        out.append(
            {
                "job": job,
                "model": model,
                "method": method,
                "rows": len(rows),
                "failed": len(failed),
                "first error": (failed[0]["error"][:80] if failed else ""),
            }
        )
    return out


def quality(table: pa.Table) -> tuple[list[dict], list[str]]:
    """Mean score per (method, cache_size), per task and averaged over tasks (tasks equally weighted)."""
    per: dict[tuple, list[float]] = defaultdict(list)
    tasks: set[str] = set()
    for row in _rows(table):
        if row.get("error") or row.get("score") is None:
            continue
        task = row.get("task") or "all"
        tasks.add(task)
        per[(*_setting(row), task)].append(float(row["score"]))
    task_list = sorted(tasks)
    settings = sorted({(m, c) for m, c, _ in per})
    out = []
    for method, size in settings:
        entry = {"method": method, "cache_size": size}
        means = []
        for task in task_list:
            vals = per.get((method, size, task))
            entry[task] = _mean(vals) if vals else None
            if vals:
                means.append(entry[task])
        entry["average"] = _mean(means)
        entry["n"] = sum(len(per.get((method, size, t), [])) for t in task_list)
        out.append(entry)
    return out, task_list


def compression_loss(quality_rows: list[dict]) -> list[dict]:
    """Relative loss of the average score vs the full cache: (full - score) / full. Empty when the
    rows hold no scored full-cache setting (an ordinary job's output: nothing to compare with)."""
    full = [r["average"] for r in quality_rows if r["method"] == FULL or r["cache_size"] >= 1.0]
    reference = _mean([f for f in full if f is not None])
    if not reference:
        return []
    out = []
    for r in quality_rows:
        if r["cache_size"] >= 1.0 or r["average"] is None:
            continue
        loss = (reference - r["average"]) / reference
        out.append(
            {
                "method": r["method"],
                "cache_size": r["cache_size"],
                "average": r["average"],
                "full_cache": reference,
                "relative_loss": loss,
            }
        )
    return out


def fidelity(table: pa.Table) -> list[dict]:
    """Mean answer NLL and its increase over the full cache per (method, cache_size), compressed
    settings only (rows of sweeps, which carry ``answer_nll_delta``)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in _rows(table):
        if not row.get("error") and row.get("answer_nll_delta") is not None and _setting(row)[0] != FULL:
            groups[_setting(row)].append(row)
    return [
        {
            "method": method,
            "cache_size": size,
            "rows": len(rows),
            "nll": _mean([r["answer_nll"] for r in rows]),
            "nll_delta": _mean([r["answer_nll_delta"] for r in rows]),
        }
        for (method, size), rows in sorted(groups.items())
    ]


def costs(table: pa.Table) -> list[dict]:
    """Median TTFT, compression, decode speed, kept fraction and KV bytes per (method, cache_size)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in _rows(table):
        if not row.get("error"):
            groups[_setting(row)].append(row)
    out = []
    for (method, size), rows in sorted(groups.items()):
        kept = [r["kv_bytes_kept"] / r["kv_bytes_full"] for r in rows if r.get("kv_bytes_full")]
        out.append(
            {
                "method": method,
                "cache_size": size,
                "rows": len(rows),
                "ttft_s": _median([r.get("ttft_s") for r in rows]),
                "compress_s": _median([r.get("compress_s") for r in rows]),
                "decode_ms_per_token": _median([r.get("decode_ms_per_token") for r in rows]),
                "kept_bytes_fraction": _mean(kept),
                "kv_kept_MiB": _median([(r.get("kv_bytes_kept") or 0) / 2**20 for r in rows]),
                "peak_memory_MiB": _median([(r.get("peak_memory_bytes") or 0) / 2**20 for r in rows]),
            }
        )
    return out


def markdown(rows: list[dict], columns: list[str] | None = None, digits: int = 3) -> str:
    if not rows:
        return "_no rows_\n"
    columns = columns or list(rows[0])

    def fmt(value) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:.{digits}f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"
