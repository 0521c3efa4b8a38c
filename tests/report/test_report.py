"""Report: aggregation against hand-computed values, and the files it writes."""

import pyarrow.parquet as pq
import pytest

from pipeline.data.schema import rows_to_table
from pipeline.report import build_report, comparisons, tables
from pipeline.report.__main__ import main


def _rows():
    rows = []
    for method, size, scores in [
        ("none", 1.0, [1.0, 1.0]),
        ("snapkv", 0.2, [0.5, 0.0]),
        ("criticalkv-snapkv", 0.2, [1.0, 0.5]),
    ]:
        for task, score in zip(["niah_single_1", "vt"], scores):
            rows.append(
                dict(
                    doc_id=f"{task}-0",
                    question_id="0",
                    job="eval",
                    task=task,
                    model="m",
                    method=method,
                    cache_size=size,
                    score=score,
                    ttft_s=1.0 if method == "none" else 0.5,
                    compress_s=0.1,
                    decode_ms_per_token=10.0,
                    kv_bytes_full=1000,
                    kv_bytes_kept=int(1000 * size) + 4,
                    peak_memory_bytes=2**20,
                    answer_nll=1.0 + (1.0 - size) * score,
                    answer_nll_delta=(1.0 - size) * score,
                )
            )
    rows.append(
        dict(
            doc_id="bad",
            question_id="0",
            job="eval",
            task="vt",
            model="m",
            method="snapkv",
            cache_size=0.2,
            error="ValueError: context is empty",
        )
    )
    return rows


def test_aggregates_match_hand_computed(tmp_path):
    table = rows_to_table(_rows())
    quality, tasks = tables.quality(table)
    by = {(r["method"], r["cache_size"]): r for r in quality}
    assert tasks == ["niah_single_1", "vt"]
    assert by[("snapkv", 0.2)]["average"] == pytest.approx(0.25)
    assert by[("criticalkv-snapkv", 0.2)]["average"] == pytest.approx(0.75)
    loss = {r["method"]: r["relative_loss"] for r in tables.compression_loss(quality)}
    assert loss == {"snapkv": pytest.approx(0.75), "criticalkv-snapkv": pytest.approx(0.25)}
    overview = {r["method"]: r for r in tables.overview(table)}
    assert overview["snapkv"]["failed"] == 1 and overview["snapkv"]["rows"] == 3
    cost = {r["method"]: r for r in tables.costs(table)}
    assert cost["snapkv"]["kept_bytes_fraction"] == pytest.approx(0.204)
    fidelity = {r["method"]: r for r in tables.fidelity(table)}
    assert set(fidelity) == {"snapkv", "criticalkv-snapkv"}  # compressed settings only
    assert fidelity["snapkv"]["nll_delta"] == pytest.approx(0.8 * 0.25)
    assert fidelity["criticalkv-snapkv"]["nll"] == pytest.approx(1.0 + 0.8 * 0.75)


def test_best_methods_and_criticalkv_effect_match_hand_computed():
    table = rows_to_table(_rows())
    loss = tables.compression_loss(tables.quality(table)[0])
    fid = tables.fidelity(table)
    best = comparisons.best_methods(loss, fid, top=5)
    assert [r["method"] for r in best] == ["criticalkv-snapkv", "snapkv"]  # by score, best first
    assert best[0]["of_full_cache"] == pytest.approx(0.75) and best[0]["nll_delta"] == pytest.approx(0.6)
    (effect,) = comparisons.criticalkv_effect(loss, fid)
    assert effect["base"] == "snapkv" and effect["cache_size"] == 0.2
    assert effect["loss_ratio"] == pytest.approx(0.25 / 0.75)  # CriticalKV lowers the loss here ...
    assert effect["nll_delta_ratio"] == pytest.approx(0.6 / 0.2)  # ... and raises the NLL increase
    (summary,) = comparisons.criticalkv_summary([effect])
    assert summary["loss_lower_in"] == "1/1" and summary["nll_delta_lower_in"] == "0/1"


def test_best_methods_break_score_ties_by_fidelity():
    loss = [{"method": m, "cache_size": 0.2, "average": 0.5, "full_cache": 1.0, "relative_loss": 0.5} for m in "abc"]
    fid = [{"method": "a", "cache_size": 0.2, "nll_delta": 0.3}, {"method": "b", "cache_size": 0.2, "nll_delta": 0.1}]
    assert [r["method"] for r in comparisons.best_methods(loss, fid, top=2)] == ["b", "a"]


def test_best_methods_rank_unscored_documents_by_fidelity_alone():
    """Own documents without references: no row is scored, the methods rank by the NLL increase."""
    fid = [
        {"method": "a", "cache_size": 0.2, "nll_delta": 0.3},
        {"method": "b", "cache_size": 0.2, "nll_delta": 0.1},
        {"method": "a", "cache_size": 0.4, "nll_delta": 0.05},
        {"method": "b", "cache_size": 0.4, "nll_delta": 0.07},
    ]
    best = comparisons.best_methods([], fid, top=5)
    assert [(r["cache_size"], r["method"]) for r in best] == [(0.2, "b"), (0.2, "a"), (0.4, "a"), (0.4, "b")]
    assert best[0]["average"] is None and best[0]["of_full_cache"] is None and best[0]["nll_delta"] == 0.1
    scored = [{"method": "a", "cache_size": 0.2, "average": 0.4, "full_cache": 0.8, "relative_loss": 0.5}]
    assert [r["method"] for r in comparisons.best_methods(scored, fid[:2])] == ["a", "b"]  # scored ones first


def test_report_files_and_cli(tmp_path):
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    pq.write_table(rows_to_table(_rows()), out / "data" / "part-0.parquet")
    md = build_report([out], out)
    text = md.read_text()
    assert "Score by method and cache size" in text and "compression_loss.png" in text
    assert "Answer fidelity" in text and "fidelity.png" in text
    assert "Best methods per cache size" in text and "CriticalKV against top-k" in text
    for name in ["score_vs_cache_size.png", "compression_loss.png", "costs.png", "fidelity.png"]:
        assert (out / name).stat().st_size > 5000
    assert main([str(out)]) == 0
    assert main([str(tmp_path / "missing")]) == 2


def test_perturbation_section(tmp_path):
    import pyarrow as pa

    rows = []
    for method, base, crit, value in [("snapkv", "snapkv", False, 2.0), ("criticalkv-snapkv", "snapkv", True, 1.0)]:
        for layer in range(3):
            for head in range(2):
                rows.append(
                    dict(
                        doc_id="d",
                        query_kind="question",
                        probe="later",
                        method=method,
                        base_method=base,
                        criticalkv=crit,
                        cache_size=0.2,
                        layer=layer,
                        kv_head=head,
                        perturbation=value * (2.0 if (layer, head) == (0, 0) and crit else 1.0),
                        hidden_deviation=0.1,
                    )
                )
    out = tmp_path / "pert"
    out.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), out / "perturbation.parquet")
    text = build_report([out], out).read_text()
    assert "| later | criticalkv-snapkv | snapkv | 0.200 | 6 | 0.833 |" in text
    assert (out / "perturbation_heatmap.png").stat().st_size > 5000


def test_plots_of_many_methods_stay_readable(tmp_path):
    from PIL import Image

    from pipeline.report import plots

    methods = [f"method-{i:02d}" for i in range(40)]
    loss = [
        {"method": m, "cache_size": size, "relative_loss": 0.0 if i < 10 else i / 40}
        for i, m in enumerate(methods)
        for size in (0.1, 0.2, 0.4)
    ]
    fid = [{"method": r["method"], "cache_size": r["cache_size"], "nll_delta": r["relative_loss"]} for r in loss]
    for path in (plots.compression_loss(loss, tmp_path / "l.png"), plots.fidelity(fid, tmp_path / "f.png")):
        width, height = Image.open(path).size
        assert width <= 2000 and height <= 1400  # one panel per cache size, a row per method
    costs = [
        {
            "method": m,
            "cache_size": size,
            "ttft_s": 1.0,
            "compress_s": 0.1,
            "decode_ms_per_token": 9.0,
            "kv_kept_MiB": 2.0,
        }
        for m in methods
        for size in (0.1, 0.2, 0.4)
    ]
    width, height = Image.open(plots.costs(costs, tmp_path / "c.png")).size
    assert width <= 2000 and height <= 2400
    styles = plots._styles(methods)
    assert max(abs(s["offset"]) for s in styles.values()) <= 0.025 + 1e-9


@pytest.mark.parametrize("with_nll", [False, True])
def test_report_of_a_job_without_full_cache_rows(tmp_path, with_nll):
    """An ordinary QA or summary job has one compressed setting and no full-cache rows: the report
    still writes its tables (no loss relative to a full cache it does not have)."""
    rows = [r for r in _rows() if r["method"] == "snapkv"]
    for r in rows:
        if not with_nll:
            r.pop("answer_nll", None), r.pop("answer_nll_delta", None)
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    pq.write_table(rows_to_table(rows), out / "data" / "part-0.parquet")
    text = build_report([out], out).read_text()
    assert "Score by method and cache size" in text and "relative to the full cache" not in text
    assert ("Answer fidelity" in text) is with_nll
    assert not (out / "compression_loss.png").exists()
    assert main([str(out)]) == 0
