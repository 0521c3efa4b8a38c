"""Pair two sweeps' rows of one method per document and cache size: score ÷ the full cache's (mean over
tasks), mean answer NLL Δ, and a two-sided sign test on the NLL Δ; optionally only the documents a
KVzap file was not calibrated on.

    python docs/results/self-calibration/compare.py A/data B/data [--method-a NAME] [--method-b NAME]
        [--exclude-calibrated FILE] [--by-task]

``A`` holds ``criticalkv-shares-kvzap`` rows (the file under test); ``B`` the same method's rows of the
reference, or ``--method-b`` (e.g. ``criticalkv-layer-kvzip``). Both sweeps must hold the same documents.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import pyarrow.parquet as pq
from safetensors import safe_open

METHOD = "criticalkv-shares-kvzap"


def load(path: str, method: str) -> tuple[dict, dict]:
    """(doc_id -> full-cache row, cache size -> {doc_id -> row of ``method``})."""
    full, cells = {}, defaultdict(dict)
    for row in pq.read_table(path).to_pylist():
        if row["method"] == "none":
            full[row["doc_id"]] = row
        elif row["method"] == method:
            cells[row["cache_size"]][row["doc_id"]] = row
    return full, cells


def sign_p(worse: int, better: int) -> float:
    n, k = worse + better, min(worse, better)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0


def score_ratio(cells: dict, full: dict, docs: list[str]) -> float:
    """Mean over tasks of the method's mean score, over the same for the full cache."""
    mine, ref = defaultdict(list), defaultdict(list)
    for doc in docs:
        mine[cells[doc]["task"]].append(cells[doc]["score"] or 0.0)
        ref[full[doc]["task"]].append(full[doc]["score"] or 0.0)
    mean = lambda by: sum(sum(v) / len(v) for v in by.values()) / len(by)  # noqa: E731
    return mean(mine) / mean(ref)


def calibrated_on(path: str) -> set[str]:
    with safe_open(path, "pt") as handle:
        return set(json.loads(handle.metadata()["settings"]).get("documents") or [])


def report_full_cache_differences(full_a: dict, full_b: dict) -> None:
    """Say whether the two sweeps' full-cache rows agree (same prediction, same answer NLL)."""
    shared = sorted(set(full_a) & set(full_b))
    differ = [
        d
        for d in shared
        if full_a[d]["prediction"] != full_b[d]["prediction"]
        or abs((full_a[d]["answer_nll"] or 0.0) - (full_b[d]["answer_nll"] or 0.0)) > 1e-4
    ]
    print(f"full cache: {len(shared)} shared documents, {len(differ)} differ:", differ[:5])


def print_by_task(a: dict, b: dict, docs: list[str]) -> None:
    """Per task: mean of A's NLL delta minus B's, and how many documents A made better."""
    by_task = defaultdict(list)
    for doc in docs:
        by_task[a[doc]["task"]].append(a[doc]["answer_nll_delta"] - b[doc]["answer_nll_delta"])
    for task, diffs in sorted(by_task.items()):
        better = sum(x < -1e-9 for x in diffs)
        print(f"    {task}: {sum(diffs) / len(diffs):+.3f}, better in {better} of {len(diffs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--method-a", default=METHOD, help="A's method column (a variant: NAME[knob=value])")
    parser.add_argument("--method-b", default=METHOD)
    parser.add_argument("--exclude-calibrated", help="a KVzap file: leave out the documents it was calibrated on")
    parser.add_argument("--by-task", action="store_true", help="also A's NLL delta minus B's per task")
    args = parser.parse_args()
    full_a, cells_a = load(args.a, args.method_a)
    full_b, cells_b = load(args.b, args.method_b)
    report_full_cache_differences(full_a, full_b)
    skip = calibrated_on(args.exclude_calibrated) if args.exclude_calibrated else set()
    for size in sorted(cells_a):
        a, b = cells_a[size], cells_b.get(size, {})
        docs = sorted(d for d in a if d in b and d not in skip)
        nll_a = sum(a[d]["answer_nll_delta"] for d in docs) / len(docs)
        nll_b = sum(b[d]["answer_nll_delta"] for d in docs) / len(docs)
        worse = sum(a[d]["answer_nll_delta"] > b[d]["answer_nll_delta"] + 1e-9 for d in docs)
        better = sum(a[d]["answer_nll_delta"] < b[d]["answer_nll_delta"] - 1e-9 for d in docs)
        kept = max(r["kv_bytes_kept"] / r["kv_bytes_full"] for r in a.values())
        print(
            f"cache {size}: {len(docs)} documents; score / full {score_ratio(a, full_a, docs):.2f} vs "
            f"{score_ratio(b, full_b, docs):.2f}; NLL delta {nll_a:.3f} vs {nll_b:.3f}; A worse in {worse}, "
            f"better in {better}, sign test p = {sign_p(worse, better):.3f}; largest kept bytes {kept:.4f}"
        )
        if args.by_task:
            print_by_task(a, b, docs)


if __name__ == "__main__":
    main()
