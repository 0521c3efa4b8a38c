"""Comparisons across methods in a sweep: the best methods per cache size, and what the CriticalKV
selection changes against top-k on the same scorer and allocation.

Rows come from :func:`pipeline.report.tables.compression_loss` (average score and relative loss per
method and cache size) and :func:`pipeline.report.tables.fidelity` (mean answer-NLL increase). The
method spelling is ``[selection-][allocation-]scorer`` with the selection first, so a CriticalKV
method's top-k counterpart is its name without the ``criticalkv-`` prefix (no registry import:
the report stays free of torch).
"""

from __future__ import annotations

CRITICALKV_PREFIX = "criticalkv-"


def best_methods(loss_rows: list[dict], fidelity_rows: list[dict], top: int = 5) -> list[dict]:
    """Per cache size, the ``top`` methods by average score (ties broken by the lower NLL increase),
    with their score as a fraction of the full cache's; methods without a scored row (documents
    without references) rank after the scored ones, by the NLL increase alone."""
    nll = {(r["method"], r["cache_size"]): r["nll_delta"] for r in fidelity_rows}
    scored = {(r["method"], r["cache_size"]): r for r in loss_rows}
    out = []
    for size in sorted({size for _, size in set(nll) | set(scored)}):
        methods = sorted({m for m, s in set(nll) | set(scored) if s == size})
        methods.sort(
            key=lambda m: (
                -scored[(m, size)]["average"] if (m, size) in scored else float("inf"),
                _or_inf(nll.get((m, size))),
            )
        )
        for rank, method in enumerate(methods[:top], start=1):
            row = scored.get((method, size), {})
            full = row.get("full_cache")
            out.append(
                {
                    "cache_size": size,
                    "rank": rank,
                    "method": method,
                    "average": row.get("average"),
                    "of_full_cache": (row["average"] / full) if full else None,
                    "nll_delta": nll.get((method, size)),
                }
            )
    return out


def criticalkv_effect(loss_rows: list[dict], fidelity_rows: list[dict]) -> list[dict]:
    """For every CriticalKV method whose top-k counterpart is in the sweep, per cache size: both
    relative losses and NLL increases, and the ratios CriticalKV / top-k (< 1: CriticalKV lowers it)."""
    loss = {(r["method"], r["cache_size"]): r["relative_loss"] for r in loss_rows}
    nll = {(r["method"], r["cache_size"]): r["nll_delta"] for r in fidelity_rows}
    out = []
    for method, size in sorted(set(loss) | set(nll)):
        if not method.startswith(CRITICALKV_PREFIX):
            continue
        base = method[len(CRITICALKV_PREFIX) :]
        if (base, size) not in loss and (base, size) not in nll:
            continue
        entry = {"base": base, "cache_size": size}
        for label, values in (("loss", loss), ("nll_delta", nll)):
            topk, critical = values.get((base, size)), values.get((method, size))
            entry[f"{label}_topk"], entry[f"{label}_criticalkv"] = topk, critical
            entry[f"{label}_ratio"] = _ratio(critical, topk)
        out.append(entry)
    return out


def criticalkv_summary(effect_rows: list[dict]) -> list[dict]:
    """Per base method (scorer and allocation), over cache sizes: mean losses and NLL increases of
    top-k and CriticalKV, and in how many cache sizes CriticalKV was lower."""
    by_base: dict[str, list[dict]] = {}
    for row in effect_rows:
        by_base.setdefault(row["base"], []).append(row)
    out = []
    for base, rows in sorted(by_base.items()):
        entry = {"base": base, "sizes": len(rows)}
        for label in ("loss", "nll_delta"):
            pairs = [(r[f"{label}_topk"], r[f"{label}_criticalkv"]) for r in rows]
            pairs = [(t, c) for t, c in pairs if t is not None and c is not None]
            entry[f"{label}_topk"] = _mean([t for t, _ in pairs])
            entry[f"{label}_criticalkv"] = _mean([c for _, c in pairs])
            entry[f"{label}_lower_in"] = f"{sum(c < t for t, c in pairs)}/{len(pairs)}"
        out.append(entry)
    return out


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _or_inf(value: float | None) -> float:
    return float("inf") if value is None else value
