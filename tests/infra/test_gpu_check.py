"""benchmarks/gpu_check.{py,sh} keep working on CPU (--smoke), so the rare GPU run is not the first run.

The GPU itself is exercised only by running ``bash benchmarks/gpu_check.sh`` on a GPU machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_model

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_table_on_cpu(tmp_path, capsys):
    rc = gpu_check.main(
        [
            "--smoke",
            "--device",
            "cpu",
            "--lengths",
            "400",
            "--batch-lengths",
            "400",
            "--repeats",
            "1",
            "--decode-steps",
            "2",
            "--decode-warmup",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| 400 |")]
    prefill_rows = [r.split("|")[2].strip() for r in rows if r.count("|") > 14]
    # every method in the check's order, then the first once more: would order change its decode?
    assert prefill_rows == [*gpu_check.METHODS, "none (again, last)"]
    assert {"criticalkv-layer-kvzip", "kvzip", "criticalkv-shares-kvzap", "criticalkv-shares-kvzap[chunked]"} < set(
        prefill_rows
    )
    batch_rows = [r.split("|")[2].strip() + "/" + r.split("|")[3].strip() for r in rows if r.count("|") <= 14]
    assert batch_rows == ["none/—", "snapkv/—", "criticalkv-layer-kvzip/—", "criticalkv-layer-kvzip/sdpa"]
    assert all(r.rstrip().endswith("| ok |") for r in rows), table
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    by = {r["method"]: r for r in result["rows"]}
    assert by["none"]["kept_bytes"] >= by["none"]["full_bytes"]  # full cache + positions/segment tables
    assert by["criticalkv-snapkv"]["kept_bytes"] < 0.3 * by["criticalkv-snapkv"]["full_bytes"]
    assert all(r["decode_ms"] > 0 and r["prefill_median_s"] > 0 for r in result["rows"])
    assert all(0 < r["host_ms"] <= r["decode_ms"] for r in result["rows"])  # launch time, within the step
    assert by["none (again, last)"]["kept_bytes"] == by["none"]["kept_bytes"]
    chunked, one_pass = by["criticalkv-shares-kvzap[chunked]"], by["criticalkv-shares-kvzap"]
    assert result["info"]["prefill_chunk"] == 128 < 400  # four chunks, each compressed at the final budget
    assert chunked["kept_bytes"] < 0.3 * chunked["full_bytes"] and one_pass["kept_bytes"] < 0.3 * one_pass["full_bytes"]
    assert by["snapkv"]["kernel"] == "dense-grouped"  # CPU: grouped matmuls over the uniform view
    assert by["criticalkv-adakv-snapkv"]["kernel"] == "flat"  # CPU, one small ragged row
    batch = {(r["method"], r["forced"]): r for r in result["throughput"]}
    full, uniform = batch[("none", "—")], batch[("snapkv", "—")]
    for r in result["throughput"]:  # the batch fits the budget, one more row would not
        assert r["batch"] * r["row_bytes"] <= 0.002 * 2**30 < (r["batch"] + 1) * r["row_bytes"]
        assert 0.9 * r["batch"] * r["row_bytes"] <= r["kv_bytes"] <= r["batch"] * r["row_bytes"]
        assert r["tokens_per_s"] > 0 and 0 < r["host_ms"] <= r["step_ms"]
    assert uniform["batch"] >= 4 * full["batch"]  # a 20 % cache: about five times the rows
    assert batch[("criticalkv-layer-kvzip", "sdpa")]["kernel"] == "sdpa"
    assert batch[("criticalkv-layer-kvzip", "—")]["kernel"] == "blocked"  # ragged rows, read in place
    assert (tmp_path / "gpu_check.md").read_text().strip() == table.strip()


def test_gpu_check_refuses_the_8b_shape_on_cpu(capsys):
    assert gpu_check.main(["--device", "cpu"]) == 2
    assert "--smoke" in capsys.readouterr().err


def test_gpu_check_model_is_llama_31_8b_shaped():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**gpu_model.LLAMA_31_8B, tie_word_embeddings=False))
    assert abs(sum(p.numel() for p in model.parameters()) - 8.03e9) < 0.01e9


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_sh_smoke_without_tests(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_BUDGET_S="240")
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--smoke", "--skip-tests", "--lengths", "96", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 96 | criticalkv-snapkv |" in proc.stdout
    assert "tests/kv on" in proc.stdout and "skipped (--skip-tests)" in proc.stdout
    assert "compile probe: exit status 0" in proc.stdout and "| default | eager |" in proc.stdout
    assert "interleaved decode: exit status 0" in proc.stdout and "| 2 | criticalkv-snapkv |" in proc.stdout
    for name in ("gpu_check.md", "gpu_check.json", "gpu_check.log", "compile_probe.md", "gpu_decode_ab.md"):
        assert (tmp_path / name).is_file(), name


def test_interleaved_decode_smoke_on_cpu(tmp_path):
    from benchmarks import gpu_decode_ab

    argv = ["--smoke", "--device", "cpu", "--batches", "1,2", "--rounds", "3", "--warmup", "1", "--out", str(tmp_path)]
    assert gpu_decode_ab.main(argv) == 0
    result = json.loads((tmp_path / "gpu_decode_ab.json").read_text())
    rows = {(r["batch"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(b, m) for b in (1, 2) for m in gpu_decode_ab.DEFAULT_METHODS.split(",")}
    for b in (1, 2):
        full, kept = rows[(b, "none")], rows[(b, "criticalkv-snapkv")]
        assert full["speedup"] == 1.0 and kept["ms"] > 0
        assert kept["kv_bytes"] < 0.3 * full["kv_bytes"]  # 20 % of the entries, in a batch of b copies
    assert rows[(2, "none")]["kv_bytes"] > 1.9 * rows[(1, "none")]["kv_bytes"]
