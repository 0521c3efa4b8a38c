"""Settings that cannot work are refused in one line with exit 2 before any work: an output inside
the input (either way round, local or object storage), a non-finite or unparsable number, an OOM
retry that would keep more than the first try; and a context given as a pipe is read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.apps.batch_jobs import config_from_args, main
from pipeline.data import sample_qa_documents, write_documents
from pipeline.data.locations import resolve
from pipeline.distributed.rundir import JobConfigError, check_apart
from tests.engine.test_model_source import save_tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layout", ["output inside input", "input inside output", "same place"])
def test_an_output_inside_the_input_or_around_it_exits_2_before_any_work(tmp_path, capsys, layout):
    inputs = tmp_path / "in"
    write_documents(sample_qa_documents(2, 40, 0), inputs / "docs.jsonl")
    output, source = {
        "output inside input": (inputs / "out", inputs),
        "input inside output": (tmp_path, inputs / "docs.jsonl"),
        "same place": (inputs, inputs),
    }[layout]
    with pytest.raises(SystemExit) as caught:
        main("longdoc_qa", ["--input", str(source), "--output", str(output)])
    err = capsys.readouterr().err.strip().splitlines()
    assert caught.value.code == 2 and len(err) == 1 and "a rerun would read the job's own output" in err[0]
    assert not (inputs / "out").exists() and not (output / "manifest.json").exists()


def test_object_store_prefixes_and_symlinks_are_compared_too(tmp_path):
    with pytest.raises(JobConfigError, match="is inside the input s3://b/in"):
        check_apart("s3://b/in", resolve("s3://b/in/out"))
    check_apart("s3://b/input", resolve("s3://b/in"))  # a shared name prefix is not inside
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(JobConfigError, match="is inside the input"):
        check_apart(str(tmp_path / "link"), resolve(str(tmp_path / "real" / "out")))
    check_apart("org/some-hub-dataset", resolve(str(tmp_path / "out")))  # not a path: nothing to compare


@pytest.mark.parametrize("value", ["inf", "nan", "abc", "-inf"])
def test_a_number_flag_that_is_not_a_finite_number_is_one_line(value, capsys):
    with pytest.raises(SystemExit) as caught:
        config_from_args("longdoc_qa", ["--kv-memory", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert caught.value.code == 2 and len(err) == 1 and "--kv-memory" in err[0] and "--help" in err[0]


def test_an_oom_retry_that_keeps_more_than_the_first_try_is_refused(capsys):
    with pytest.raises(SystemExit):
        config_from_args("longdoc_qa", ["--cache-size", "0.2", "--oom-retry-cache-size", "0.4"])
    assert "must be below the cache size" in capsys.readouterr().err
    assert config_from_args("longdoc_qa", ["--cache-size", "0.4", "--oom-retry-cache-size", "0.2"])


def test_generate_reads_a_context_given_as_a_pipe(tmp_path):
    missing = [
        sys.executable,
        "-m",
        "pipeline.generate",
        "--context-file",
        str(tmp_path / "nope.txt"),
        "--question",
        "q",
    ]
    proc = subprocess.run(missing, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "no such file" in proc.stderr
    # bash's <(...) hands the program a /dev/fd path to a pipe
    model = save_tiny(tmp_path / "tiny")
    script = (
        f"{sys.executable} -m pipeline.generate --model {model} --method criticalkv-layer-kvzip --max-new-tokens 2 "
        "--question 'What is it?' --context-file <(echo 'A pipe context of a few words.')"
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no such file" not in proc.stderr


# ---------------------------------------------------------------------- object stores that cannot answer
# loopback only: the GCS client's metadata server and an S3 endpoint where nothing listens
NO_STORE = {
    "GCE_METADATA_ROOT": "127.0.0.1:9",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _job(args: list[str], tmp_path, timeout_s: str = "5") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_"))}
    env.update(NO_STORE, CRITICALKV_STORAGE_TIMEOUT_S=timeout_s)
    command = [sys.executable, str(ROOT / "jobs" / "longdoc_qa.py"), *args]
    return subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("uri", ["gs://criticalkv-no-bucket/docs.jsonl", "s3://criticalkv-no-bucket/docs.jsonl"])
def test_an_object_store_without_credentials_exits_2_within_a_minute(tmp_path, uri):
    t0 = time.perf_counter()
    proc = _job(["--input", uri, "--output", str(tmp_path / "out")], tmp_path)
    err = proc.communicate(timeout=120)[1].strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "cannot access" in err[0], err
    assert time.perf_counter() - t0 < 60 and len(err[0]) < 600
    if uri.startswith("gs://"):
        assert "no Google Cloud credentials" in err[0]


def test_sigterm_during_an_object_store_check_exits_143_at_once(tmp_path):
    proc = _job(["--input", "gs://criticalkv-no-bucket/docs.jsonl", "--output", str(tmp_path / "out")], tmp_path, "60")
    time.sleep(8)  # past the imports, inside the check (which takes 60 s or more here)
    assert proc.poll() is None
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=30)[1]
    assert proc.returncode == 143 and time.perf_counter() - t0 < 5 and "interrupted (SIGTERM)" in err
