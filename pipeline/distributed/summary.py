"""End-of-run summary of output rows: counts, latency, cache savings, throughput.

Works on any table with the output schema (one run's rows, or a whole output directory read back).
Cache figures count each compressed cache once: a document's questions share one cache, except in
query-aware mode where every question is prefilled (and compressed) with its own copy of the context.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pyarrow as pa


@dataclass
class RunSummary:
    rows: int
    rows_ok: int
    rows_failed: int
    docs: int
    ttft_mean_s: float | None
    ttft_p95_s: float | None
    kept_fraction_mean: float | None
    kv_bytes_full: int
    kv_bytes_kept: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    output: str
    rows_skipped: int = 0
    decode_ms_per_token_median: float | None = None  # one sequence's decode step, median over rows
    decode_batch_mean: float | None = None  # rows decoded together per step, over every row's steps

    @property
    def kv_bytes_saved(self) -> int:
        return self.kv_bytes_full - self.kv_bytes_kept

    @property
    def tokens_per_s(self) -> float | None:
        return (self.prompt_tokens + self.generated_tokens) / self.wall_s if self.wall_s > 0 else None

    @property
    def generated_tokens_per_s(self) -> float | None:
        """Generated tokens over the whole job's wall time (model loading, prefill, Ray included)."""
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def docs_per_hour(self) -> float | None:
        """Documents answered per hour of the job's wall time (this run's rows)."""
        return 3600.0 * self.docs / self.wall_s if self.wall_s > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode speed of one sequence: 1000 / the median decode ms per token of the rows."""
        return 1000.0 / self.decode_ms_per_token_median if self.decode_ms_per_token_median else None

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "kv_bytes_saved": self.kv_bytes_saved,
            "tokens_per_s": self.tokens_per_s,
            "generated_tokens_per_s": self.generated_tokens_per_s,
            "docs_per_hour": self.docs_per_hour,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


def _percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method) of a non-empty list."""
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(
    table: pa.Table, wall_s: float, output: str = "", query_aware: bool = False, rows_skipped: int = 0
) -> RunSummary:
    """Summary of the rows in ``table`` produced in ``wall_s`` seconds."""
    rows = table.select(
        [
            c
            for c in (
                "doc_id",
                "question_id",
                "method",
                "cache_size",
                "error",
                "ttft_s",
                "context_tokens",
                "question_tokens",
                "generated_tokens",
                "kv_bytes_full",
                "kv_bytes_kept",
                "decode_ms_per_token",
                "decode_batch",
            )
            if c in table.column_names
        ]
    ).to_pylist()
    ok = [r for r in rows if r.get("error") is None]
    caches: dict[tuple, dict] = {}
    for r in ok:
        # one compressed cache per document and setting (sweeps and OOM retries have several)
        key = (r["doc_id"], r.get("method"), r.get("cache_size"))
        key = (*key, r["question_id"]) if query_aware else key
        caches.setdefault(key, r)
    fractions = [c["kv_bytes_kept"] / c["kv_bytes_full"] for c in caches.values() if c.get("kv_bytes_full")]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    per_token = [r["decode_ms_per_token"] for r in ok if r.get("decode_ms_per_token")]
    # a row's decode steps ~ its generated tokens: weight each row's occupancy by them
    occupancy = [(r["decode_batch"], r.get("generated_tokens") or 0) for r in ok if r.get("decode_batch")]
    steps = sum(w for _, w in occupancy)
    return RunSummary(
        rows=len(rows),
        rows_ok=len(ok),
        rows_failed=len(rows) - len(ok),
        docs=len({r["doc_id"] for r in rows}),
        ttft_mean_s=sum(ttft) / len(ttft) if ttft else None,
        ttft_p95_s=_percentile(ttft, 95),
        kept_fraction_mean=sum(fractions) / len(fractions) if fractions else None,
        kv_bytes_full=sum(c.get("kv_bytes_full") or 0 for c in caches.values()),
        kv_bytes_kept=sum(c.get("kv_bytes_kept") or 0 for c in caches.values()),
        prompt_tokens=sum(c.get("context_tokens") or 0 for c in caches.values())
        + sum(r.get("question_tokens") or 0 for r in ok),
        generated_tokens=sum(r.get("generated_tokens") or 0 for r in ok),
        wall_s=wall_s,
        output=output,
        rows_skipped=rows_skipped,
        decode_ms_per_token_median=_percentile(per_token, 50),
        decode_batch_mean=sum(b * w for b, w in occupancy) / steps if steps else None,
    )


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{n} B"


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def format_summary(s: RunSummary, title: str = "run summary") -> str:
    """A short two-column text table."""
    saved = f"{_bytes(s.kv_bytes_saved)} of {_bytes(s.kv_bytes_full)}" if s.kv_bytes_full else "-"
    lines = [
        ("rows ok / failed", f"{s.rows_ok} / {s.rows_failed}  ({s.docs} documents)"),
        ("rows from earlier runs (kept)", str(s.rows_skipped)),
        ("TTFT mean / p95", f"{_num(s.ttft_mean_s, '.3f', ' s')} / {_num(s.ttft_p95_s, '.3f', ' s')}"),
        ("mean kept KV fraction", _num(s.kept_fraction_mean, ".1%")),
        ("KV bytes saved", saved),
        ("tokens / job wall time (prompt+generated)", _num(s.tokens_per_s, ",.0f", " tok/s")),
        ("generated tokens / job wall time", _num(s.generated_tokens_per_s, ",.1f", " tok/s")),
        ("documents / hour of job wall time", _num(s.docs_per_hour, ",.0f")),
        ("decode speed per sequence (1000 / median ms per token)", _num(s.decode_tokens_per_s, ",.1f", " tok/s")),
        ("rows decoded together per step (mean)", _num(s.decode_batch_mean, ".1f")),
        ("wall time", f"{s.wall_s:.1f} s"),
        ("output", s.output),
    ]
    width = max(len(k) for k, _ in lines)
    rule = "-" * (width + 2 + max(len(v) for _, v in lines))
    return "\n".join([title, rule, *(f"{k:<{width}}  {v}" for k, v in lines), rule])
