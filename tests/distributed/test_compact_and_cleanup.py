"""Compaction of a finished output, recovery of a dead driver's local Ray processes, and the
summarize job's sentence-ending budget."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pyarrow.parquet as pq
import pytest

from pipeline.apps.batch_jobs import main
from pipeline.compact import compact
from pipeline.compact import main as compact_main
from pipeline.data import write_documents
from pipeline.data.schema import SCHEMA_VERSION_KEY
from pipeline.distributed import sink
from pipeline.distributed.cluster import stop_dead_sessions
from pipeline.distributed.config import LongDocQAJob, SummarizeJob
from pipeline.engine.decoding import last_sentence_end

from .conftest import TINY_JOB_ARGS, small_docs

TINY = [*TINY_JOB_ARGS, "--max-new-tokens", "2"]


def _rows(data) -> list[tuple]:
    return sorted((r["doc_id"], r["question_id"], r["prediction"]) for r in pq.read_table(data).to_pylist())


def test_compaction_merges_keeps_rows_and_metadata_and_a_rerun_resumes(local_ray, tmp_path):
    path = write_documents(small_docs(5, seed=21), tmp_path / "in.jsonl")
    out = tmp_path / "out"
    argv = ["--input", str(path), "--output", str(out), *TINY]
    assert main("longdoc_qa", argv) == 0
    data = out / "data"
    before = _rows(data)
    assert len(sink.committed_files(data)) == 5
    assert compact(str(out), rows_per_file=3) == (5, 2)  # 3 + 2 rows
    assert compact(str(out), rows_per_file=100) == (2, 1)
    assert compact(str(out), rows_per_file=100) == (1, 1)  # nothing left to do
    (merged,) = sink.committed_files(data)
    assert SCHEMA_VERSION_KEY in (pq.read_schema(merged.path).metadata or {})
    assert _rows(data) == before
    assert main("longdoc_qa", argv) == 0  # the compacted output still resumes: nothing recomputed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runs"][-1]["summary"]["rows_skipped"] == len(before) and _rows(data) == before


def test_compaction_refuses_what_is_not_a_job_output(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert compact_main([str(tmp_path / "x")]) == 2
    assert "holds no manifest.json" in capsys.readouterr().err
    assert compact_main([str(tmp_path / "x"), "--rows-per-file", "0"]) == 2


def _identity(proc: psutil.Process) -> dict:
    return {"pid": proc.pid, "started": proc.create_time(), "name": proc.name()}


def test_dead_drivers_recorded_processes_are_stopped_by_pid_only(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dead_driver = {"pid": dead.pid, "started": time.time() - 100, "name": "python"}
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        left = _identity(psutil.Process(leftover.pid))
        # the same PID with another start time is another process (a reused PID): never touched
        reused = {**_identity(psutil.Process(bystander.pid)), "started": time.time() - 1000}
        (tmp_path / "driver-1.json").write_text(json.dumps({"driver": dead_driver, "processes": [left, reused]}))
        alive_driver = _identity(psutil.Process())
        (tmp_path / "driver-2.json").write_text(json.dumps({"driver": alive_driver, "processes": [left]}))
        assert stop_dead_sessions(tmp_path) == 1
        assert leftover.wait(timeout=10) is not None and bystander.poll() is None
        assert not (tmp_path / "driver-1.json").exists() and (tmp_path / "driver-2.json").exists()
    finally:
        for proc in (leftover, bystander):
            proc.kill()
            proc.wait()


_OWN_RECORD_SCRIPT = """
import json, subprocess, sys
from pathlib import Path
from pipeline.distributed.cluster import LocalRayRecord
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
try:
    record = LocalRayRecord(Path(sys.argv[1]))
    record.write()
    listed = {p["pid"] for p in json.loads(record.path.read_text())["processes"]}
    assert child.pid in listed, listed
    assert record.stop_leftovers() >= 1 and child.wait(timeout=10) is not None
    assert not record.path.exists()
finally:
    child.kill()
    child.wait()
print("ok")
"""


def test_a_drivers_own_record_lists_its_children_and_is_removed_at_shutdown(tmp_path):
    # in a process of its own: the record lists (and stops) every child of the process that writes it,
    # which in this test process includes the module's local Ray
    done = subprocess.run(
        [sys.executable, "-c", _OWN_RECORD_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The cat sat. The dog ran to the", "The cat sat."),
        ('He said "stop!" and then', 'He said "stop!"'),
        ("Is it? Yes. Maybe not", "Is it? Yes."),
        ("version 2.5 is out and", "version 2.5 is out and"),  # no sentence end: unchanged
        ("Done.", "Done."),
    ],
)
def test_last_sentence_end(text, expected):
    assert last_sentence_end(text) == expected


def test_summaries_get_a_paragraph_budget_that_ends_at_a_sentence():
    summarize, qa = SummarizeJob().generation, LongDocQAJob().generation
    assert summarize.max_new_tokens >= 200 and summarize.end_at_sentence
    assert not qa.end_at_sentence
