"""Committed files, resume bookkeeping, de-duplication and the summary table (no Ray)."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from pipeline.data import SCHEMA_VERSION, question_hashes, rows_to_table
from pipeline.distributed import sink
from pipeline.distributed.summary import format_summary, summarize


def _rows(*keys, error=None, run="r"):
    return rows_to_table(
        [
            {
                "doc_id": d,
                "question_id": q,
                "run_id": run,
                "error": error,
                "prediction": "x",
                "kv_bytes_full": 100,
                "kv_bytes_kept": 40,
                "context_tokens": 10,
                "question_tokens": 2,
                "generated_tokens": 3,
                "ttft_s": 0.1,
            }
            for d, q in keys
        ]
    )


def _bump_mtime(path, seconds):
    stat = os.stat(path)  # a local Location is os.PathLike
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + int(seconds * 1e9)))


def test_commit_is_atomic_and_idempotent(tmp_path):
    table = _rows(("a", "0"), ("a", "1"))
    first = sink.commit_table(table, tmp_path, "r1")
    again = sink.commit_table(table, tmp_path, "r1")  # a retried write of the same rows
    assert first == again and first.name.startswith("part-r1-") and sink.committed_files(tmp_path) == [first]
    assert not list(tmp_path.glob(".tmp-*")) and pq.read_table(first).num_rows == 2
    assert pq.read_schema(first).metadata[b"pipeline.schema_version"] == str(SCHEMA_VERSION).encode()


def test_committed_state_and_done(tmp_path):
    sink.commit_table(_rows(("a", "0"), ("a", "1")), tmp_path, "r1")
    sink.commit_table(_rows(("b", "0"), error="OOM"), tmp_path, "r1")
    (tmp_path / ".tmp-part-x.parquet").write_bytes(b"half")
    state = sink.committed_state(tmp_path)
    assert state.rows == 3
    assert state.done("a", ["0", "1"]) and not state.done("a", ["0", "1", "2"])
    assert state.done("b", ["0"]) and not state.done("b", ["0"], retry_errors=True)
    assert not state.done("c", ["0"])
    assert sink.remove_debris(tmp_path) == 1 and not list(tmp_path.glob(".tmp-*"))


def test_dedupe_keeps_the_first_row_and_prefers_rows_without_error(tmp_path):
    old = sink.commit_table(_rows(("a", "0"), ("b", "0"), error="OOM"), tmp_path, "r1")
    new = sink.commit_table(_rows(("a", "0"), ("b", "0"), ("c", "0"), run="r2"), tmp_path, "r2")
    dup = sink.commit_table(_rows(("c", "0"), run="r3"), tmp_path, "r3")
    _bump_mtime(new, 1), _bump_mtime(dup, 2)
    removed = sink.dedupe(tmp_path, "r4")
    assert removed == 3  # a and b: the error rows go; c: the later copy goes
    table = sink.read_committed(tmp_path)
    rows = {(r["doc_id"], r["question_id"]): r for r in table.to_pylist()}
    assert table.num_rows == 3 and set(rows) == {("a", "0"), ("b", "0"), ("c", "0")}
    assert all(r["error"] is None and r["run_id"] == "r2" for r in rows.values())
    assert not old.exists() and not dup.exists()
    assert sink.dedupe(tmp_path, "r5") == 0


def test_summary_counts_each_cache_once():
    table = _rows(("a", "0"), ("a", "1"), ("b", "0"))
    s = summarize(table, wall_s=2.0, output="OUT")
    assert (s.rows, s.rows_ok, s.rows_failed, s.docs) == (3, 3, 0, 2)
    assert s.kv_bytes_full == 200 and s.kv_bytes_saved == 120 and s.kept_fraction_mean == pytest.approx(0.4)
    assert s.prompt_tokens == 2 * 10 + 3 * 2 and s.generated_tokens == 9
    assert s.tokens_per_s == pytest.approx((26 + 9) / 2.0) and s.ttft_p95_s == pytest.approx(0.1)
    assert s.docs_per_hour == pytest.approx(3600.0) and s.as_dict()["docs_per_hour"] == s.docs_per_hour
    aware = summarize(table, wall_s=2.0, query_aware=True)
    assert aware.kv_bytes_full == 300
    text = format_summary(s)
    for label in (
        "rows ok / failed",
        "TTFT mean / p95",
        "mean kept KV fraction",
        "KV bytes saved",
        "generated tokens / job wall time",
        "documents / hour of job wall time",
        "decode speed per sequence (1000 / median ms per token)",
        "wall time",
        "output",
    ):
        assert label in text


def test_summary_occupancy_weights_each_row_by_its_generated_tokens():
    table = _rows(("a", "0"), ("b", "0"))  # 3 tokens each
    rows = table.to_pylist()
    rows[0]["decode_batch"], rows[1]["decode_batch"], rows[1]["generated_tokens"] = 4.0, 1.0, 9
    s = summarize(rows_to_table(rows), wall_s=1.0)
    assert s.decode_batch_mean == pytest.approx((4.0 * 3 + 1.0 * 9) / 12)
    assert "rows decoded together per step (mean)" in format_summary(s)
    assert summarize(table, wall_s=1.0).decode_batch_mean is None  # no decode steps recorded


def test_summary_of_failed_and_empty_runs():
    s = summarize(_rows(("a", "0"), error="boom"), wall_s=1.0)
    assert (s.rows_ok, s.rows_failed) == (0, 1) and s.ttft_mean_s is None and s.kept_fraction_mean is None
    assert "-" in format_summary(s)
    empty = summarize(_rows(), wall_s=0.0)
    assert empty.rows == 0 and empty.tokens_per_s is None


def test_commit_all_closes_the_stream_before_a_commit_error_propagates(tmp_path, monkeypatch):
    """A commit that fails (a full disk) must stop the producing iterator at once: Ray Data stops its
    executor in the iterator's ``finally``; left to the garbage collector it outlived ray.shutdown()."""
    closed = []

    def stream():
        try:
            yield _rows(("a", "0"))
            yield _rows(("b", "0"))
            yield _rows(("c", "0"))
        finally:
            closed.append(True)

    committer = sink.BatchCommitter(tmp_path, "r1")  # a file per table: the second one fails
    real_commit, calls = sink.commit_table, []

    def failing_commit(table, *args):
        calls.append(table.num_rows)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        real_commit(table, *args)

    monkeypatch.setattr(sink, "commit_table", failing_commit)
    with pytest.raises(OSError, match="No space left") as failure:
        committer.commit_all(stream())
    assert failure.value is not None and closed == [True]  # closed while the error's traceback lives
    assert [pq.read_metadata(f).num_rows for f in sink.committed_files(tmp_path)] == [1]


def test_changed_inputs_names_documents_whose_rows_came_from_other_content():
    import pyarrow as pa

    doc = {"doc_id": "a", "context": "ctx", "questions": ["q0", "q1"], "question_ids": ["0", "1"]}
    doc |= {"answer_prefix": None, "max_new_tokens": None}
    digest = question_hashes(doc)
    committed = sink.Committed({"a": {"0", "1"}}, {"a": {"0", "1"}}, 2, {"a": set(digest.values())})
    same, other_context = dict(doc), dict(doc, context="new")
    other_question, other_limit = dict(doc, questions=["q0", "Q1"]), dict(doc, max_new_tokens=5)
    assert sink.changed_inputs(pa.Table.from_pylist([same]), committed) == []
    for changed in (other_context, other_question, other_limit):
        assert sink.changed_inputs(pa.Table.from_pylist([changed]), committed) == ["a"]
    new_doc = dict(doc, doc_id="b", context="new")  # nothing committed for it: nothing to compare
    assert sink.changed_inputs(pa.Table.from_pylist([new_doc]), committed) == []
    assert question_hashes(dict(doc, question_ids=["0", "0"]))["0"] == digest["0"]  # first question of an id


def test_commit_all_commits_every_table_and_the_remainder(tmp_path):
    committer = sink.BatchCommitter(tmp_path, "r1", rows_per_file=2)
    committer.commit_all([_rows(("a", "0")), _rows(("b", "0"), ("b", "1")), _rows(("c", "0"))])
    assert (committer.files, committer.rows) == (2, 4)


def test_batch_committer_commits_each_table_or_bundles_rows(tmp_path):
    committed = []
    each = sink.BatchCommitter(tmp_path / "each", "r1", on_commit=lambda table, rows: committed.append(table))
    each.add(_rows(("a", "0"), ("a", "1")))
    each.add(_rows())  # an empty block commits nothing
    each.add(_rows(("b", "0")))
    assert (each.files, each.rows) == (2, 3) and [t.num_rows for t in committed] == [2, 1]
    each.flush()  # nothing held: no empty file
    assert len(sink.committed_files(tmp_path / "each")) == 2

    bundled = sink.BatchCommitter(tmp_path / "bundled", "r1", rows_per_file=3)
    bundled.add(_rows(("a", "0"), ("a", "1")))
    assert sink.committed_files(tmp_path / "bundled") == []  # held until 3 rows
    bundled.add(_rows(("b", "0")))
    bundled.add(_rows(("c", "0")))
    assert [pq.read_metadata(f).num_rows for f in sink.committed_files(tmp_path / "bundled")] == [3]
    bundled.flush()  # the remainder, whole documents
    assert sorted(pq.read_metadata(f).num_rows for f in sink.committed_files(tmp_path / "bundled")) == [1, 3]
    assert sink.committed_state(tmp_path / "bundled").done("c", ["0"])
