"""The driver's durability contract, as a user meets it (each test runs real job processes).

* default settings commit one file per document as it is answered: a driver SIGKILLed after the first
  commit loses only the documents in flight, and its rerun recomputes only the uncommitted ones;
* a SIGKILLed driver's local Ray processes are stopped by the next run (by their recorded PIDs);
  SIGTERM ends a job like Ctrl-C, leaving no Ray process behind;
* a full disk (a 40 KiB tmpfs) fails with one sentence, committed files intact, and a rerun into
  another output completes exactly once (skipped where mounting is not allowed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from pipeline.data import write_documents
from pipeline.distributed.sink import committed_files
from tests.distributed.conftest import TINY_JOB_ARGS, small_docs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _command(path: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "jobs" / "longdoc_qa.py"),
        "--input",
        str(path),
        "--output",
        str(out),
        *TINY_JOB_ARGS,
        "--max-new-tokens",
        "32",
        "--num-actors",
        "1",
        *extra,
    ]


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", "CRITICALKV_CACHE_DIR": str(tmp_path / "cache")}


def _wait_for_commits(proc, data: Path, count: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and len(committed_files(data) if data.exists() else []) < count:
        assert proc.poll() is None, "the job finished before the fault; make it longer"
        time.sleep(0.2)
    assert len(committed_files(data)) >= count


def _recorded(tmp_path: Path) -> list[dict]:
    records = sorted((tmp_path / "cache" / "ray-sessions").glob("driver-*.json"))
    return [p for r in records for p in json.loads(r.read_text())["processes"]]


def _running(entries: list[dict]) -> list[dict]:
    out = []
    for e in entries:
        try:
            if abs(psutil.Process(e["pid"]).create_time() - e["started"]) < 1e-3:
                out.append(e)
        except psutil.NoSuchProcess:
            pass
    return out


def _keys(out: Path) -> Counter:
    return Counter(
        (r["doc_id"], r["question_id"])
        for f in committed_files(out / "data")
        for r in pq.read_table(f.path).to_pylist()
    )


def test_driver_sigkill_default_settings_rerun_recomputes_only_the_rest(tmp_path):
    docs = small_docs(8, words=150, seed=21)
    path = write_documents(docs, tmp_path / "in.jsonl")
    out, env = tmp_path / "out", _env(tmp_path)
    proc = subprocess.Popen(
        _command(path, out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_for_commits(proc, out / "data", 1)
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone, without warning
    finally:
        proc.kill()
        proc.wait(timeout=30)
    before = _keys(out)
    left = _running(_recorded(tmp_path))
    assert before and len(before) < sum(len(d["question_ids"]) for d in docs)
    rerun = subprocess.run(_command(path, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    keys = _keys(out)
    assert set(keys) == {(d["doc_id"], q) for d in docs for q in d["question_ids"]} and max(keys.values()) == 1
    # only the uncommitted documents were redone: the dead driver's Ray workers may still have
    # committed a batch in flight before the rerun stopped them, which the rerun then keeps
    kept = json.loads((out / "manifest.json").read_text())["runs"][-1]["summary"]["rows_skipped"]
    assert kept >= len(before) and summary["rows_written"] == len(keys) - kept
    assert not _running(left), "the dead driver's local Ray processes are still running"


def test_sigterm_interrupts_and_leaves_no_ray_process(tmp_path):
    docs = small_docs(8, words=150, seed=22)
    path = write_documents(docs, tmp_path / "in.jsonl")
    out, env = tmp_path / "out", _env(tmp_path)
    proc = subprocess.Popen(
        _command(path, out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for_commits(proc, out / "data", 1)
        recorded = _recorded(tmp_path)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143
    assert recorded and not _running(recorded)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runs"][-1]["status"] == "interrupted"


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_full_disk_fails_with_one_sentence_and_loses_nothing(tmp_path, tiny_disk):
    docs = small_docs(8, words=150, seed=23)
    path = write_documents(docs, tmp_path / "in.jsonl")
    env = _env(tmp_path)
    proc = subprocess.run(
        _command(path, tiny_disk / "out"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: run ") and "No space left on device" in last and "free space" in last
    assert "rerun the same command" in last and "Traceback" not in proc.stderr.split("error: run ")[-1]
    committed = _keys(tiny_disk / "out")  # whole files only, each document once
    assert max(committed.values(), default=1) == 1
    manifest = tiny_disk / "out" / "manifest.json"
    if "manifest could not be updated" not in last:
        assert json.loads(manifest.read_text())["runs"][-1]["status"] == "failed"
    rerun = subprocess.run(
        _command(path, tmp_path / "elsewhere"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    keys = _keys(tmp_path / "elsewhere")
    assert set(keys) == {(d["doc_id"], q) for d in docs for q in d["question_ids"]} and max(keys.values()) == 1
