"""A job with the learned scorer on a model that has no KVzap file calibrates one on its own input
first (``--calibrate auto``), records it, answers with it, and reuses it on a rerun; ``--calibrate off``
refuses in one sentence naming what to do."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pipeline.apps.batch_jobs import main
from pipeline.apps.self_calibration import file_name, needs_calibration
from pipeline.distributed.config import LongDocQAJob
from pipeline.distributed.predictor import local_kvzap_files
from pipeline.engine.kvzap_file import read_metadata
from tests.engine.test_model_source import save_tiny

KVZAP = ["--method", "criticalkv-shares-kvzap", "--cache-size", "0.5", "--window", "4"]
SMALL = ["--sample-docs", "4", "--sample-words", "80", "--max-new-tokens", "3", "--num-actors", "1"]
SMALL += ["--cpus-per-actor", "1", "--calibration-docs", "4"]
SHARES = {"method": "shares-kvzap", "cache_size": 0.4}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model") / "tiny")


def test_which_jobs_need_a_calibration(tiny_dir, tmp_path):
    job = LongDocQAJob(output=str(tmp_path / "o"), model={"name": str(tiny_dir)}, compression=SHARES)
    assert (
        needs_calibration(job) and file_name(job).startswith("kvzap-") and file_name(job).endswith("--tiny.safetensors")
    )
    assert "/" not in file_name(job)
    assert not needs_calibration(job.model_copy(update={"model": job.model.model_copy(update={"name": "smollm2"})}))
    default = LongDocQAJob(output=str(tmp_path / "o"), model={"name": str(tiny_dir)})
    assert needs_calibration(default)  # the default method is the learned scorer: a new model calibrates first
    plain = LongDocQAJob(output=str(tmp_path / "o"), model={"name": str(tiny_dir)}, compression={"method": "snapkv"})
    assert not needs_calibration(plain)
    with pytest.raises(ValidationError, match="file not found"):  # a named file that is missing still fails now
        LongDocQAJob(
            output=str(tmp_path / "o"),
            model={"name": str(tiny_dir)},
            compression={**SHARES, "kvzap_model": str(tmp_path / "none.safetensors")},
        )


def test_calibrate_off_refuses_naming_the_command_and_a_method_without_calibration(tiny_dir, tmp_path):
    with pytest.raises(ValidationError) as caught:
        LongDocQAJob(output=str(tmp_path / "o"), model={"name": str(tiny_dir)}, compression=SHARES, calibrate="off")
    message = str(caught.value)
    assert "jobs/calibrate_kvzap.py --model" in message and "--calibrate auto" in message
    assert "criticalkv-layer-defensivekv" in message and not (tmp_path / "o").exists()


def test_kvzap_file_bytes_land_on_a_node_that_lacks_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tmp_path / "cache"))
    here = tmp_path / "k.safetensors"
    here.write_bytes(b"same bytes")
    local = local_kvzap_files({str(here): b"same bytes", "/elsewhere/k.safetensors": b"other bytes"})
    assert local[str(here)] == str(here)  # the driver's path holds the same bytes here
    copy = local["/elsewhere/k.safetensors"]
    assert copy.startswith(str(tmp_path / "cache")) and open(copy, "rb").read() == b"other bytes"


def test_job_calibrates_on_its_own_input_answers_and_reuses_the_file(local_ray, tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--model", str(tiny_dir), "--output", str(out), *KVZAP, *SMALL]
    assert main("longdoc_qa", args) == 0
    captured = capsys.readouterr()
    assert "calibrating the learned scorer" in captured.err and "held-out R2" in captured.err
    assert "learned scorer: calibrated in" in captured.out and "4 of your documents" in captured.out
    files = list((out / "calibration").glob("kvzap-*.safetensors"))
    assert len(files) == 1
    meta = read_metadata(files[0])
    assert meta["model"] == str(tiny_dir) and len(meta["settings"]["documents"]) == 4
    manifest = json.loads((out / "manifest.json").read_text())
    first = manifest["runs"][-1]["calibration"]
    assert first["reused"] is False and len(first["documents"]) == 4 and "r2" in first["fit"]
    assert manifest["identity"]["compression"]["kvzap_model"] == str(files[0])
    assert manifest["totals"]["rows_with_error"] == 0 and manifest["totals"]["docs"] == 4
    stamp = files[0].stat().st_mtime_ns
    assert main("longdoc_qa", args) == 0  # a rerun: nothing left to answer, the file is reused
    again = json.loads((out / "manifest.json").read_text())["runs"][-1]["calibration"]
    assert again["reused"] is True and files[0].stat().st_mtime_ns == stamp
    captured = capsys.readouterr()
    assert "calibrating" not in captured.err and "learned scorer: reused 4 of your documents" in captured.out
