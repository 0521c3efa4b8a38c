"""A job given a model it does not have: a Hub id (a local server plays the Hub) or an ``s3://``
directory (moto) is fetched where the actors run, from a clean cache, with two actors; a model that
cannot be had exits 2 in seconds with one sentence, before Ray starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.data.locations import resolve
from tests.engine.test_model_source import hub_repos, save_tiny
from tests.hub_server import HubServer
from tests.s3_server import s3_server

ROOT = Path(__file__).resolve().parents[2]
# two 1-CPU actors, one document per call, the built-in samples kept short; a method that needs no KVzap file
JOB = ["--num-actors", "2", "--cpus-per-actor", "1", "--batch-size", "1", "--sample-docs", "4"]
JOB += ["--sample-words", "60", "--max-new-tokens", "3", "--method", "criticalkv-layer-kvzip"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with HubServer(hub_repos(tmp_path_factory.mktemp("repos"))) as server:
        yield server


def run_job(tmp: Path, model: list[str], env: dict, timeout: int = 600) -> tuple[subprocess.CompletedProcess, float]:
    """``jobs/longdoc_qa.py`` in a fresh process with empty model caches under ``tmp``."""
    environ = {**os.environ, "HF_HUB_CACHE": str(tmp / "hf"), "CRITICALKV_CACHE_DIR": str(tmp / "ck"), **env}
    environ.pop("HF_HUB_OFFLINE", None)
    environ.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    args = [sys.executable, str(ROOT / "jobs" / "longdoc_qa.py"), *model, "--output", str(tmp / "out"), *JOB]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=environ)
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize(
    "model, message",
    [
        (["--model", "org/missing"], "no model 'org/missing' on the Hub"),
        (["--model", "org/gated"], "is gated and this token has no access"),
        (["--model", "org/tiny", "--model-revision", "v9"], "has no revision 'v9'"),
        (["--model", "org/pickled"], "no *.safetensors weights on the Hub"),
        (["--model", "org/custom"], "--trust-remote-code"),
    ],
)
def test_a_model_that_cannot_be_had_exits_2_in_seconds_before_ray(hub, tmp_path, model, message):
    hub.downloads.clear()
    proc, seconds = run_job(tmp_path, model, {"HF_ENDPOINT": hub.url}, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Ray" not in proc.stderr and seconds < 60
    assert not (tmp_path / "out").exists()
    assert {key.rsplit("/", 1)[1] for key in hub.downloads} <= {"config.json"}  # no weights were fetched


def test_an_s3_model_that_cannot_be_read_exits_2_before_ray(tmp_path):
    with s3_server("models") as env:
        proc, seconds = run_job(tmp_path, ["--model", "s3://no-such-bucket/llama"], env, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "no-such-bucket" in lines[0], proc.stderr[-2000:]
    assert "credentials" in lines[0] and seconds < 60 and not (tmp_path / "out").exists()


def _answered(tmp: Path) -> tuple[list[dict], dict]:
    rows = pq.read_table(tmp / "out" / "data").to_pylist()
    manifest = json.loads((tmp / "out" / "manifest.json").read_text())
    return rows, manifest


@pytest.mark.slow
def test_job_downloads_a_hub_model_where_its_two_actors_run(hub, tmp_path):
    hub.downloads.clear()
    proc, _ = run_job(tmp_path, ["--model", "org/tiny", "--model-revision", "v1"], {"HF_ENDPOINT": hub.url})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, manifest = _answered(tmp_path)
    assert len({r["doc_id"] for r in rows}) == 4 and not any(r["error"] for r in rows)
    assert {r["model"] for r in rows} == {"org/tiny@v1"}
    source = manifest["runs"][-1]["model_source"]
    assert source == {
        "kind": "hub",
        "id": "org/tiny",
        "revision": "v1",
        "commit": hub.repos["org/tiny"].commit,
        "offline": False,
    }
    assert max(hub.downloads.values()) == 1 and "org/tiny/pytorch_model.bin" not in hub.downloads


@pytest.mark.slow
def test_job_fetches_an_s3_model_directory_where_its_two_actors_run(tmp_path):
    with s3_server("models") as env:
        for path in save_tiny(tmp_path / "tiny").iterdir():
            resolve(f"s3://models/llama/{path.name}").write_bytes(path.read_bytes())
        proc, _ = run_job(tmp_path, ["--model", "s3://models/llama"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, manifest = _answered(tmp_path)
    assert len({r["doc_id"] for r in rows}) == 4 and not any(r["error"] for r in rows)
    assert manifest["runs"][-1]["model_source"]["kind"] == "object_store"
    copies = list((tmp_path / "ck" / "models" / "remote").glob("*-llama"))
    assert len(copies) == 1 and (copies[0] / "model.safetensors").is_file()
