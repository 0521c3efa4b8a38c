"""``ray job submit`` of jobs/longdoc_qa.py to a head this test starts (slow).

The head gets its own ports and temp dir and keeps token authentication on: the test makes a
random token and hands it to the head and to ``ray job submit`` through ``RAY_AUTH_TOKEN`` (the way
a user exports the cluster's token), so nothing in ``~/.ray`` is read or written. The head runs
with ``ray start --block`` in its own session; the test stops exactly that process and its
descendants by PID -- never ``ray stop``, which would kill every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.distributed.conftest import ROOT, TINY_FACTORY

pytestmark = pytest.mark.slow
VENV_BIN = Path(sys.executable).parent


def _free_ports(n: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def _stop_tree(proc: subprocess.Popen, marker: str) -> None:
    """Stop the ``ray start --block`` process and every process of this head -- found by PID as its
    descendants or through the head's own temp dir on their command line: SIGTERM, then SIGKILL."""
    import psutil

    procs = set()
    try:
        procs.add(psutil.Process(proc.pid))
        procs.update(psutil.Process(proc.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in (part or "") for part in (p.info["cmdline"] or [])):
                procs.add(p)
                procs.update(p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs), timeout=8)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    proc.wait(timeout=5)


@pytest.fixture
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="rh-", dir="/tmp")
    gcs, dashboard, client, agent_grpc, agent_http, metrics, runtime_env = _free_ports(7)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",  # the job's `python` is the head's
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
    )
    cmd = [
        str(VENV_BIN / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={gcs}",
        f"--dashboard-port={dashboard}",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
        "--num-cpus=2",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    log = open(Path(temp_dir) / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_port(dashboard, 90)
        yield {"address": f"http://127.0.0.1:{dashboard}", "env": env, "temp_dir": temp_dir}
    finally:
        _stop_tree(proc, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _submit(head, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [
        str(VENV_BIN / "ray"),
        "job",
        "submit",
        "--address",
        head["address"],
        "--working-dir",
        str(ROOT),
        "--",
        "python",
        "jobs/longdoc_qa.py",
        *args,
    ]
    return subprocess.run(cmd, env=head["env"], capture_output=True, text=True, timeout=timeout)


def test_ray_job_submit_writes_parquet_with_token_auth(ray_head, tmp_path):
    out = tmp_path / "out"
    args = [
        "--output",
        str(out),
        "--model",
        "tiny-llama",
        "--engine-factory",
        TINY_FACTORY,
        "--method",
        "snapkv",
        "--cache-size",
        "0.5",
        "--window",
        "4",
        "--kernel",
        "3",
        "--sample-docs",
        "3",
        "--sample-words",
        "60",
        "--max-new-tokens",
        "3",
        "--cpus-per-actor",
        "1",
    ]
    proc = _submit(ray_head, args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "succeeded" in proc.stdout and "rows ok / failed" in proc.stdout
    table = pq.read_table(out / "data")
    keys = list(zip(table.column("doc_id").to_pylist(), table.column("question_id").to_pylist()))
    assert len(keys) == len(set(keys)) == 4  # 3 sample documents, one of them with two questions
    manifest = json.loads((out / "manifest.json").read_text())
    run = manifest["runs"][-1]
    assert run["status"] == "completed" and run["ray"]["address"] not in ("", None)
    assert "started by this job" not in run["ray"]["address"]  # it used the head, not a Ray of its own

    # without the token the head refuses the submission (authentication stayed on)
    refused = subprocess.run(
        [str(VENV_BIN / "ray"), "job", "submit", "--address", ray_head["address"], "--", "python", "-c", "print(1)"],
        env={**ray_head["env"], "RAY_AUTH_TOKEN": "0" * 64},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "uthentication" in (refused.stdout + refused.stderr)
