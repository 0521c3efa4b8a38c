"""``jobs/calibrate_kvzap.py`` checks everything it can before any work (one line, exit 2, no Ray,
no model load), writes its file with the process's umask, and its ``--help`` says what it does."""

from __future__ import annotations

import os
import time

import pytest

from pipeline.apps.calibrate_kvzap import main
from pipeline.engine.kvzap_file import write_kvzap
from tests.tiny import tiny_kvzap


def _refused(argv, capsys) -> str:
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as caught:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert caught.value.code == 2 and len(err) == 1 and time.perf_counter() - t0 < 30, err
    return err[0]


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import ray

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    out = ["--output", str(tmp_path / "k.safetensors")]
    assert "is a directory" in _refused(["--output", str(tmp_path), "--lengths", "512", "--documents", "8"], capsys)
    assert "at least 128 tokens" in _refused([*out, "--lengths", "64", "--documents", "8"], capsys)
    assert "no document to fit on" in _refused([*out, "--lengths", "512", "--documents", "1"], capsys)
    assert "no document to fit on" in _refused([*out, "--documents", "0"], capsys)
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    if not os.access(tmp_path / "ro", os.W_OK):  # root may write anywhere: then there is nothing to refuse
        args = ["--output", str(tmp_path / "ro" / "k.safetensors"), "--documents", "8", "--lengths", "512"]
        message = _refused(args, capsys)
        assert "cannot be written" in message
    model = _refused([*out, "--model", "no-such/model", "--lengths", "512", "--documents", "8"], capsys)
    assert model.startswith("error: invalid model.name") and "no-such/model" in model
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text("{}")
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"x")
    pickled = [*out, "--model", str(tmp_path / "pickled"), "--lengths", "512", "--documents", "8"]
    assert "safetensors" in _refused(pickled, capsys)
    assert not ray.is_initialized() and not (tmp_path / "k.safetensors").exists()


def test_the_output_directory_is_created_and_the_file_follows_the_umask(tmp_path):
    kvzap = tiny_kvzap(2, 2, 64)
    old = os.umask(0o022)
    try:
        path = write_kvzap(tmp_path / "nested" / "k.safetensors", kvzap, "tiny-llama", {}, {}, {})
    finally:
        os.umask(old)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)


def test_help_describes_the_command_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "its cross-layer shares for one model, written as a safetensors file." in " ".join(out.split())
