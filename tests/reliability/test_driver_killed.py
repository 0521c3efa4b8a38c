"""The driver process (and the local Ray it started) is SIGKILLed part-way; rerunning the same
command completes the output with no duplicates and no loss and says how many it skipped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.data import write_documents
from pipeline.distributed.sink import committed_files
from tests.distributed.conftest import small_docs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _command(path: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "jobs" / "longdoc_qa.py"),
        "--input",
        str(path),
        "--output",
        str(out),
        "--model",
        "tiny-llama",
        "--engine-factory",
        "tests.distributed.helpers:tiny_engine",
        "--method",
        "criticalkv-snapkv",
        "--cache-size",
        "0.5",
        "--window",
        "4",
        "--kernel",
        "3",
        "--max-new-tokens",
        "48",
        "--rows-per-file",
        "1",
        "--batch-size",  # one document per call: the kill falls between commits
        "1",
        "--num-actors",
        "1",
        "--cpus-per-actor",
        "1",
    ]


def test_driver_sigkill_then_rerun(tmp_path):
    docs = small_docs(10, words=120, seed=11)
    path = write_documents(docs, tmp_path / "in.jsonl")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""}
    proc = subprocess.Popen(
        _command(path, out),
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and len(committed_files(out / "data") if (out / "data").exists() else []) < 2:
            time.sleep(0.2)
            assert proc.poll() is None, "the job finished before it could be killed; make it longer"
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started, without warning
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    before = {
        (r["doc_id"], r["question_id"]) for f in committed_files(out / "data") for r in pq.read_table(f).to_pylist()
    }
    assert 2 <= len(before) < sum(len(d["question_ids"]) for d in docs)

    rerun = subprocess.run(_command(path, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "rows from earlier runs (kept)" in rerun.stdout
    rows = [r for f in committed_files(out / "data") for r in pq.read_table(f).to_pylist()]
    keys = Counter((r["doc_id"], r["question_id"]) for r in rows)
    expected = {(d["doc_id"], q) for d in docs for q in d["question_ids"]}
    assert set(keys) == expected and max(keys.values()) == 1  # lost 0, duplicates 0
    assert before <= set(keys)
    assert not list((out / "data").glob(".tmp-*"))
