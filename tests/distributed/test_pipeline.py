"""End to end on a local Ray (one Ray start for the module) with a tiny in-code model.

Exactly-once output with the schema's types, the GPU scheduling path on CPU, resume after a
failure part-way (and after a driver that died mid-write), bad rows mixed with good ones, and
normalisation inside Ray.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import (
    OUTPUT_SCHEMA,
    SCHEMA_VERSION,
    check_output_table,
    question_hashes,
    rows_to_table,
    write_documents,
)
from pipeline.distributed import JobConfigError, JobFailed, run_job, sink
from pipeline.distributed.sink import committed_files
from tests.distributed.conftest import small_docs, tiny_config


def _keys(docs):
    return sorted((d["doc_id"], q) for d in docs for q in d["question_ids"])


def _read(data_dir) -> pa.Table:
    table = pq.read_table(data_dir)  # pyarrow's own reader: ignores .tmp-* files by itself
    check_output_table(table)
    return table


def _assert_exactly_once(table: pa.Table, docs):
    got = Counter(zip(table.column("doc_id").to_pylist(), table.column("question_id").to_pylist()))
    assert sorted(got) == _keys(docs), "every doc_id x question must appear"
    assert max(got.values()) == 1, f"duplicates: {[k for k, n in got.items() if n > 1]}"


@pytest.fixture(scope="module")
def first_run(local_ray, tmp_path_factory):
    """One complete run over a one-question-per-row Parquet file (normalised on the driver)."""
    tmp = tmp_path_factory.mktemp("first")
    docs = small_docs(6)
    path = write_documents(docs, tmp / "in.parquet", one_question_per_row=True)
    config = tiny_config(tmp / "out", input=str(path))
    return docs, config, run_job(config, echo=False)


def test_an_automatic_batch_decodes_an_actors_documents_together(local_ray, tmp_path):
    """Without --batch-size one actor's call holds the documents (here all 5): they share decode steps."""
    docs = small_docs(5)
    path = write_documents(docs, tmp_path / "in.parquet")
    generation = {"batch_size": None, "max_new_tokens": 6}
    config = tiny_config(tmp_path / "out", input=str(path), generation=generation, rows_per_file=None)
    assert config.batch_size_for(len(docs)) == 5
    result = run_job(config, echo=False)
    rows = pq.read_table(result.data_dir).to_pylist()
    assert len(rows) == sum(len(d["question_ids"]) for d in docs) and all(r["error"] is None for r in rows)
    assert max(r["decode_batch"] or 0 for r in rows) > 1
    # one call, yet a file per document: each reached the driver as it finished, not at the call's end
    files = committed_files(result.data_dir)
    per_file = [set(pq.read_table(f.path).column("doc_id").to_pylist()) for f in files]
    assert len(files) == 5 and all(len(ids) == 1 for ids in per_file)


def test_a_document_is_committed_while_its_call_still_works(local_ray, faults, tmp_path):
    """Issue #50: the first document of a call of two is committed before the second is prefilled.
    The second's prefill waits for that commit (at most 60 s); an iterator that hands a block on only
    when the next arrives (Ray's ``prefetch_batches=1``) would leave it waiting for itself."""
    docs = small_docs(2)
    path = write_documents(docs, tmp_path / "in.parquet")
    marker = tmp_path / "commit-seen"
    config = tiny_config(
        tmp_path / "out",
        input=str(path),
        rows_per_file=None,
        generation={"batch_size": 2, "decode_between_prefills": 100.0},  # the first ends before the next prefill
    )
    wait = {"before": docs[1]["doc_id"], "dir": str(tmp_path / "out" / "data"), "timeout_s": 60, "marker": str(marker)}
    faults(wait_for_commit=wait)
    result = run_job(config, echo=False)
    assert marker.read_text() == "committed"
    assert result.rows_written == sum(len(d["question_ids"]) for d in docs)


def test_every_question_exactly_once_with_schema_types(first_run):
    docs, config, result = first_run
    table = _read(result.data_dir)
    _assert_exactly_once(table, docs)
    assert table.schema.equals(OUTPUT_SCHEMA, check_metadata=False)
    rows = table.to_pylist()
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]]
    assert {r["run_id"] for r in rows} == {result.run_id}
    assert {(r["job"], r["model"], r["method"], r["cache_size"], r["budget"]) for r in rows} == {
        ("longdoc_qa", "tiny-llama", "criticalkv-snapkv", 0.5, None)
    }
    by_key = {(d["doc_id"], q): d["references"][i] for d in docs for i, q in enumerate(d["question_ids"])}
    for r in rows:
        assert r["reference"] == by_key[(r["doc_id"], r["question_id"])]
        assert r["score"] is None and r["prediction"] is not None and r["context_tokens"] > 0
        assert 0 < r["kv_bytes_kept"] < r["kv_bytes_full"] and r["ttft_s"] > 0 and r["device"].startswith("cpu")
        assert 1 <= r["generated_tokens"] <= 3
        assert r["finish_reason"] == ("length" if r["generated_tokens"] == 3 else "stop")
        assert r["decode_batch"] is None or 1.0 <= r["decode_batch"] <= config.batch_size_for(len(docs))
    hashes = {(d["doc_id"], q): h for d in docs for q, h in question_hashes(d).items()}
    assert all(r["input_hash"] == hashes[(r["doc_id"], r["question_id"])] for r in rows)
    assert result.missing_rows == 0 and result.duplicates_removed == 0
    assert result.summary.rows_ok == len(rows) and result.summary.kept_fraction_mean < 0.75
    assert len(committed_files(result.data_dir)) >= 2  # committed file by file, not at the end


def test_manifest_records_the_run(first_run):
    _, config, result = first_run
    manifest = json.loads(result.manifest_path.read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["identity"] == config.identity()
    run = manifest["runs"][-1]
    assert run["run_id"] == result.run_id and run["status"] == "completed"
    assert run["started_at"] and run["ended_at"] and run["host"]["hostname"]
    assert run["versions"]["ray"] and run["versions"]["torch"] and run["gpu"]["actor_devices"] == ["cpu"]
    assert run["rows"]["written"] == result.rows_written and run["rows"]["missing"] == 0
    assert run["config"]["compression"]["method"] == "criticalkv-snapkv"


def test_rerun_of_a_finished_job_adds_nothing(first_run):
    docs, config, result = first_run
    again = run_job(config, echo=False)
    assert again.docs_skipped == len(docs) and again.docs_scheduled == 0 and again.rows_written == 0
    assert again.extra["ray"] == {}  # nothing to do: Ray is not even asked
    _assert_exactly_once(_read(result.data_dir), docs)


def test_rerun_with_changed_content_under_the_same_ids_warns(local_ray, tmp_path, capsys):
    """It used to write 0 rows and exit 0 silently, keeping the answers to the old content."""
    docs = small_docs(3, seed=9)
    config = tiny_config(tmp_path / "out", input=str(write_documents(docs, tmp_path / "in.jsonl")))
    run_job(config, echo=False)
    docs[1]["context"] = "An entirely different report. " * 20
    write_documents(docs, tmp_path / "in.jsonl")
    again = run_job(config, echo=True)
    assert again.rows_written == 0 and again.docs_changed == 1
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING")]
    assert len(warning) == 1 and "1 documents differ" in warning[0] and docs[1]["doc_id"] in warning[0]
    manifest = json.loads(again.manifest_path.read_text())
    assert [r["rows"]["docs_changed"] for r in manifest["runs"]] == [0, 1]


def test_rerun_with_another_method_is_refused(first_run):
    _, config, _ = first_run
    other = config.model_copy(update={"compression": config.compression.with_method("snapkv")})
    with pytest.raises(JobConfigError, match=r"output: .*different configuration.*compression.method"):
        run_job(other, echo=False)


def test_gpu_scheduling_path_on_cpu(local_ray, tmp_path):
    """``num_gpus=1`` actors schedule on the logical GPU; the engine falls back to the CPU."""
    config = tiny_config(tmp_path / "out", gpus_per_actor=1, sample_docs=2)
    result = run_job(config, echo=False)
    assert result.extra["ray"]["gpus_per_actor"] == 1 and result.extra["ray"]["cpus_per_actor"] == 1
    table = _read(result.data_dir)
    assert table.num_rows == result.rows_written > 0 and table.column("error").null_count == table.num_rows


def test_resume_after_a_failure_part_way(local_ray, faults, tmp_path):
    docs = small_docs(6, seed=3)
    path = write_documents(docs, tmp_path / "in.jsonl")
    config = tiny_config(tmp_path / "out", input=str(path), rows_per_file=1)
    faults(raise_after_batches=2, raise_delay_s=2.0)
    with pytest.raises(JobFailed, match="rerun the same command"):
        run_job(config, echo=False)
    data = tmp_path / "out" / "data"
    partial = _read(data) if committed_files(data) else OUTPUT_SCHEMA.empty_table()
    done_docs = set(partial.column("doc_id").to_pylist())
    assert 1 <= len(done_docs) <= 2 < len(docs)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["runs"][-1]["status"] == "failed" and "raise_after_batches" in manifest["runs"][-1]["error"]

    # the driver also "died mid-write": a half-written temporary file and a second copy of a committed file
    (data / ".tmp-part-dead-0000.parquet").write_bytes(b"PAR1 half a file")
    files = committed_files(data)
    if files:
        shutil.copy(files[0], data / "part-dead-copy.parquet")

    faults()
    resumed = run_job(config, echo=False)
    assert resumed.docs_skipped == len(done_docs) and resumed.docs_scheduled == len(docs) - len(done_docs)
    assert resumed.missing_rows == 0
    assert resumed.duplicates_removed == (pq.read_metadata(files[0]).num_rows if files else 0)
    _assert_exactly_once(_read(data), docs)
    assert not list(data.glob(".tmp-*"))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [r["status"] for r in manifest["runs"]] == ["failed", "completed"]
    assert manifest["runs"][-1]["temporary_files_removed"] == 1


def test_bad_rows_mixed_with_good_rows(local_ray, faults, tmp_path):
    good = small_docs(4, seed=5)
    path = tmp_path / "in.jsonl"
    lines = [json.dumps(good[0]), json.dumps(good[1])]
    lines += [
        json.dumps({"doc_id": "empty", "context": "", "questions": ["q?"]}),
        json.dumps({"doc_id": "blank", "context": "   \n ", "questions": ["q?"]}),
        json.dumps({"doc_id": "null", "context": None, "questions": ["q?"]}),
        json.dumps({"doc_id": "number", "context": 42, "questions": ["q?"]}),
        json.dumps({"doc_id": "noquestion", "context": "some text", "questions": [None]}),
        '{"doc_id": "broken", "context": ',
        json.dumps(good[2]),
        json.dumps(good[3]),
    ]
    path.write_text("\n".join(lines) + "\n")
    boom = good[3]["doc_id"]  # an unexpected exception inside the actor for this document
    faults(error_doc_ids=[boom])
    config = tiny_config(tmp_path / "out", input=str(path), generation={"batch_size": 2})
    result = run_job(config, echo=False)
    rows = {(r["doc_id"], r["question_id"]): r for r in _read(result.data_dir).to_pylist()}
    assert result.missing_rows == 0 and len(rows) == result.rows_written
    for doc in good[:3]:
        for q in doc["question_ids"]:
            row = rows.pop((doc["doc_id"], q))
            assert row["error"] is None and row["prediction"] is not None
    for q in good[3]["question_ids"]:
        assert "InjectedFault" in rows.pop((boom, q))["error"]
    errors = {doc_id: r["error"] for (doc_id, _), r in rows.items()}
    assert "context is empty" in errors.pop("empty")
    assert "only whitespace" in errors.pop("blank")
    assert "null or missing" in errors.pop("null")
    assert "expected a string" in errors.pop("number")
    assert "question 0 is null" in errors.pop("noquestion")
    assert len(errors) == 1 and "invalid JSON" in next(iter(errors.values()))  # the broken line


def _normalised_in_ray_with_one_document_done(tmp_path, one_question_per_row: bool):
    docs = small_docs(4, seed=7)
    path = write_documents(docs, tmp_path / "in.parquet", one_question_per_row=one_question_per_row)
    config = tiny_config(tmp_path / "out", input=str(path), normalise="ray")
    # an earlier run (same configuration) already committed the first document
    done = docs[0]
    (tmp_path / "out" / "data").mkdir(parents=True)
    sink.commit_table(
        rows_to_table(
            [
                {"doc_id": done["doc_id"], "question_id": q, "run_id": "earlier", "prediction": "x"}
                for q in done["question_ids"]
            ]
        ),
        tmp_path / "out" / "data",
        "earlier",
    )
    (tmp_path / "out" / "manifest.json").write_text(
        json.dumps({"schema_version": SCHEMA_VERSION, "identity": config.identity(), "runs": []})
    )
    result = run_job(config, echo=False)
    assert result.extra["normalise"] == "ray" and result.missing_rows is None
    table = _read(result.data_dir)
    _assert_exactly_once(table, docs)
    runs = {r["doc_id"]: r["run_id"] for r in table.to_pylist()}
    assert runs.pop(done["doc_id"]) == "earlier" and set(runs.values()) == {result.run_id}


def test_normalised_inside_ray_skips_done_documents(local_ray, tmp_path):
    """``normalise="ray"``, one row per document: read_parquet + map_batches(normalise_batch)."""
    _normalised_in_ray_with_one_document_done(tmp_path, one_question_per_row=False)


@pytest.mark.slow
def test_question_rows_grouped_inside_ray_skip_done_documents(local_ray, tmp_path):
    """``normalise="ray"``, one question per row: groupby(doc_id).map_groups(normalise_batch) (a shuffle)."""
    _normalised_in_ray_with_one_document_done(tmp_path, one_question_per_row=True)


def test_actor_killed_while_holding_a_batch(local_ray, faults, tmp_path):
    """The actor process exits abruptly (os._exit) while prefilling one document; Ray restarts it
    and retries the batch: every doc_id x question appears exactly once, none with an error."""
    docs = small_docs(4, seed=7)
    path = write_documents(docs, tmp_path / "in.jsonl")
    marker = tmp_path / "crashed-once"
    victim = docs[2]["doc_id"]
    faults(crash=[victim], crash_marker=str(marker))
    config = tiny_config(tmp_path / "out", input=str(path), rows_per_file=1)
    result = run_job(config, echo=False)
    assert marker.exists()  # the crash really happened
    table = _read(result.data_dir)
    _assert_exactly_once(table, docs)
    assert table.column("error").null_count == table.num_rows


def test_progress_lines_count_committed_documents(local_ray, tmp_path, capsys):
    docs = small_docs(3, seed=5)
    path = write_documents(docs, tmp_path / "in.jsonl")
    run_job(tiny_config(tmp_path / "out", input=str(path), rows_per_file=None), echo=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("committed ")]
    assert len(lines) == 3 and lines[-1].startswith("committed 3/3 documents, ")
    assert lines[-1].split(", ")[1] == f"{sum(len(d['question_ids']) for d in docs)} rows"


def test_stalled_batch_fails_the_run_after_stall_timeout(local_ray, faults, tmp_path):
    docs = small_docs(2, seed=9)
    path = write_documents(docs, tmp_path / "in.jsonl")
    faults(raise_after_batches=0, raise_delay_s=60.0)  # the first batch hangs for a minute
    config = tiny_config(tmp_path / "out", input=str(path), stall_timeout_s=3)
    with pytest.raises(JobFailed, match="made no progress"):
        run_job(config, echo=False)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["runs"][-1]["status"] == "failed" and manifest["runs"][-1]["wall_s"] < 45


def test_actors_running_other_code_than_the_driver_fail_the_run(local_ray, tmp_path, monkeypatch):
    import pipeline.distributed.dataset as dataset

    monkeypatch.setattr(dataset, "package_fingerprint", lambda: "0" * 16)  # as if the driver ran other code
    path = write_documents(small_docs(2, seed=4), tmp_path / "in.jsonl")
    with pytest.raises(JobFailed, match="imported the pipeline package from"):
        run_job(tiny_config(tmp_path / "out", input=str(path)), echo=False)
    assert committed_files(tmp_path / "out" / "data") == []
