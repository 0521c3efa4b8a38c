"""Headline of the perturbation diagnostics: CriticalKV vs its base method, from the long-format
table :func:`pipeline.eval.perturbation.analyse_document` writes (``perturbation.parquet``)."""

from __future__ import annotations

import math

import pyarrow as pa


def headline(table: pa.Table) -> list[dict]:
    """CriticalKV vs its base method, per (probe, cache_size, method) present in ``table``.

    For every ``criticalkv-X`` method whose base ``X`` is also in the table, pairs the rows on
    (doc_id, query_kind, probe, cache_size, layer, kv_head) and returns dicts with ``probe``, ``method``,
    ``base_method``, ``cache_size``, ``heads`` (pairs), ``fraction_lower`` (strictly lower
    ``perturbation``), ``fraction_equal``, ``median_ratio`` (median of perturbation / base
    perturbation over pairs where the base is > 0), ``mean_perturbation`` / ``base_mean_perturbation``,
    ``hidden_deviation`` / ``base_hidden_deviation`` (means over documents; None for the window probe).
    """
    cols = table.select(
        [
            "doc_id",
            "query_kind",
            "probe",
            "method",
            "base_method",
            "criticalkv",
            "cache_size",
            "layer",
            "kv_head",
            "perturbation",
            "hidden_deviation",
        ]
    ).to_pylist()
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in cols:
        key = (r["doc_id"], r["query_kind"], r["probe"], r["cache_size"], r["layer"], r["kv_head"])
        by_key.setdefault(key, {})[r["method"]] = r
    methods = sorted({(r["probe"], r["method"], r["base_method"], r["cache_size"]) for r in cols if r["criticalkv"]})
    out = []
    for probe, method, base, cache_size in methods:
        pairs = [
            (ms[method], ms[base])
            for key, ms in by_key.items()
            if key[2] == probe and key[3] == cache_size and method in ms and base in ms
        ]
        if pairs:
            out.append(
                {
                    "probe": probe,
                    "method": method,
                    "base_method": base,
                    "cache_size": cache_size,
                    **_pair_stats(pairs, later=probe == "later"),
                }
            )
    return out


def _pair_stats(pairs: list[tuple[dict, dict]], later: bool) -> dict:
    """Statistics of (criticalkv row, base row) pairs (see :func:`headline`)."""
    lower = sum(1 for c, b in pairs if c["perturbation"] < b["perturbation"])
    equal = sum(1 for c, b in pairs if c["perturbation"] == b["perturbation"])
    ratios = sorted(c["perturbation"] / b["perturbation"] for c, b in pairs if b["perturbation"] > 0)
    docs_c = {(c["doc_id"], c["query_kind"]): c["hidden_deviation"] for c, _ in pairs}
    docs_b = {(b["doc_id"], b["query_kind"]): b["hidden_deviation"] for _, b in pairs}
    return {
        "heads": len(pairs),
        "fraction_lower": lower / len(pairs),
        "fraction_equal": equal / len(pairs),
        "median_ratio": ratios[len(ratios) // 2] if ratios else math.nan,
        "mean_perturbation": sum(c["perturbation"] for c, _ in pairs) / len(pairs),
        "base_mean_perturbation": sum(b["perturbation"] for _, b in pairs) / len(pairs),
        "hidden_deviation": sum(docs_c.values()) / len(docs_c) if later else None,
        "base_hidden_deviation": sum(docs_b.values()) / len(docs_b) if later else None,
    }


def format_headline(rows: list[dict]) -> str:
    """One line per pair, e.g. ``[later] criticalkv-snapkv vs snapkv @ cache 0.2: perturbation lower in ...``."""
    lines = []
    for r in rows:
        line = (
            f"[{r['probe']}] {r['method']} vs {r['base_method']} @ cache {r['cache_size']:g}: perturbation lower in "
            f"{100 * r['fraction_lower']:.1f}% of {r['heads']} (doc, layer, kv-head) "
            f"(equal {100 * r['fraction_equal']:.1f}%), median ratio {r['median_ratio']:.3f}, "
            f"mean {r['mean_perturbation']:.4g} vs {r['base_mean_perturbation']:.4g}"
        )
        if r["hidden_deviation"] is not None:
            line += f"; hidden deviation {r['hidden_deviation']:.4f} vs {r['base_hidden_deviation']:.4f}"
        lines.append(line)
    return "\n".join(lines)
