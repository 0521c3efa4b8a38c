"""The input and exit-code contract of the batch jobs, one test per failure found by hand.

Exit codes (README): 0 every row answered; 3 finished but rows carry an error (above
--max-error-fraction); 2 bad input or configuration, nothing ran; 1 failed part-way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.apps.batch_jobs import main
from pipeline.data import write_documents
from pipeline.distributed import sink
from tests.distributed.conftest import ROOT, TINY_JOB_ARGS, small_docs

TINY = [*TINY_JOB_ARGS, "--max-new-tokens", "2"]


def _job(tmp_path, *args):
    return ["--output", str(tmp_path / "out"), *TINY, *args]


def _invalid(capsys, argv) -> str:
    """Run the job in-process; it must exit 2 before starting anything, with one sentence."""
    with pytest.raises(SystemExit) as info:
        main("longdoc_qa", argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: invalid ") and "Traceback" not in err, err
    return lines[0]


def test_unreadable_parquet_inputs_are_invalid_input(tmp_path, capsys):
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "text.parquet").write_text("not parquet at all")
    for name in ("empty.parquet", "text.parquet"):
        line = _invalid(capsys, ["--input", str(tmp_path / name), *_job(tmp_path)])
        assert "invalid input" in line and name in line and "not a readable Parquet file" in line
    folder = tmp_path / "dir"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(small_docs(1)), folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"")
    line = _invalid(capsys, ["--input", str(folder), *_job(tmp_path)])
    assert "b.parquet" in line and "not a readable Parquet file" in line
    assert not (tmp_path / "out").exists()


def test_unknown_files_in_an_input_directory_are_refused_or_skipped_with_a_warning(local_ray, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    docs = small_docs(2)
    pq.write_table(pa.Table.from_pylist(docs[:1]), folder / "a.parquet")
    write_documents(docs[1:], folder / "c.jsonl")
    (folder / "README.txt").write_text("notes")
    line = _invalid(capsys, ["--input", str(folder), *_job(tmp_path)])
    assert "README.txt" in line and "--ignore-unknown-files" in line
    with pytest.warns(UserWarning, match="README.txt"):
        assert main("longdoc_qa", ["--input", str(folder), "--ignore-unknown-files", *_job(tmp_path)]) == 0
    rows = pq.read_table(tmp_path / "out" / "data").to_pylist()
    assert {r["doc_id"] for r in rows} == {d["doc_id"] for d in docs}  # c.jsonl's document is there


def test_empty_inputs_are_invalid(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    pq.write_table(
        pa.table(
            {
                "doc_id": pa.array([], pa.string()),
                "context": pa.array([], pa.string()),
                "question": pa.array([], pa.string()),
            }
        ),
        tmp_path / "none.parquet",
    )
    for name in ("empty.jsonl", "none.parquet"):
        line = _invalid(capsys, ["--input", str(tmp_path / name), *_job(tmp_path)])
        assert "holds no rows" in line


def test_every_row_failing_exits_3(local_ray, tmp_path, capsys):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"doc_id": ["a", "b", "c"], "context": [1, 2, 3], "question": ["q?"] * 3}), path)
    assert main("longdoc_qa", ["--input", str(path), *_job(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "3 of 3 rows carry an error" in err
    assert main("longdoc_qa", ["--input", str(path), *_job(tmp_path), "--max-error-fraction", "1"]) == 0


def test_unknown_model_fails_fast_before_ray(tmp_path):
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "jobs" / "longdoc_qa.py"),
            "--model",
            "not-a-model-name",
            "--output",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf")},  # no network: the cache only
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not-a-model-name" in lines[0] and "local Hugging Face cache" in lines[0]
    assert "HF_HUB_OFFLINE" in lines[0]
    assert "Traceback" not in proc.stderr and "Ray" not in proc.stderr and "resume" not in proc.stderr
    assert time.perf_counter() - t0 < 60 and not (tmp_path / "out").exists()


def test_default_settings_commit_one_file_per_batch_with_idempotent_names(local_ray, tmp_path):
    docs = small_docs(4, seed=11)
    path = write_documents(docs, tmp_path / "in.jsonl")
    assert main("longdoc_qa", ["--input", str(path), *_job(tmp_path)]) == 0
    data = tmp_path / "out" / "data"
    files = sink.committed_files(data)
    assert len(files) == 4  # a batch per document, each committed on its own
    # a batch done again (retried by Ray, or redone after its driver died) lands on the same name
    first = pq.read_table(files[0].path)
    again = sink.commit_table(first, data, json.loads((tmp_path / "out" / "manifest.json").read_text())["fingerprint"])
    assert again == files[0] and len(sink.committed_files(data)) == 4
    assert sink.dedupe(data, "x") == 0


def test_longdoc_qa_scores_rows_with_references(local_ray, tmp_path):
    docs = small_docs(2, seed=12)
    path = write_documents(docs, tmp_path / "in.jsonl")
    assert main("longdoc_qa", ["--input", str(path), *_job(tmp_path)]) == 0
    rows = pq.read_table(tmp_path / "out" / "data").to_pylist()
    assert rows and all(r["reference"] and r["score"] is not None for r in rows)  # string_match_all by default
    with pytest.raises(SystemExit):
        main("longdoc_qa", ["--input", str(path), *_job(tmp_path), "--metric", "bleu"])


def test_num_actors_zero_names_the_flag(tmp_path, capsys):
    line = _invalid(capsys, ["--num-actors", "0", *_job(tmp_path)])
    assert "--num-actors (num_actors)" in line
