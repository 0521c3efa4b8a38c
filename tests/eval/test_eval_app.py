"""The compression-sweep job: its command line, the batch job it builds, and (slow) one real run."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.apps.eval_sweep import EvalJob
from pipeline.options import OptionParser

ROOT = Path(__file__).resolve().parents[2]


def test_job_config_sweeps_every_setting_over_generated_documents(tmp_path):
    parser = OptionParser(EvalJob, prog="eval")
    config, _ = parser.parse(
        [
            "--methods",
            "snapkv,layer-kvzip",
            "--cache-sizes",
            "0.2,0.4",
            "--window",
            "16",
            "--output",
            str(tmp_path / "o"),
        ]
    )
    docs = tmp_path / "docs.parquet"
    docs.write_bytes(b"")
    job = config.job_config(str(docs))
    assert [(s.method, s.cache_size) for s in job.sweep] == [
        ("none", 1.0),
        ("snapkv", 0.2),
        ("snapkv", 0.4),
        ("layer-kvzip", 0.2),
        ("layer-kvzip", 0.4),
    ]
    assert all(s.window == 16 for s in job.sweep) and job.compression == job.sweep[0]
    assert job.columns.model_fields_set == set()  # the documents are already normalised
    assert job.generation.max_new_tokens == 24 and job.job == "eval_compression"
    help_text = parser.parser.format_help()
    assert "--tasks" in help_text and "--summary-tokens" in help_text and "--sample-docs" not in help_text
    assert "--input" in help_text and "--id-column" in help_text  # own documents, with the jobs' column flags
    assert "--kv-memory" not in help_text and "--continuous" not in help_text  # sweeps use the batch path


def test_own_documents_replace_the_generated_ones(tmp_path):
    docs = tmp_path / "mine.jsonl"
    docs.write_text('{"id": "a", "text": "some context", "question": "why?"}\n')
    parser = OptionParser(EvalJob, prog="eval")
    args = ["--input", str(docs), "--id-column", "id", "--context-column", "text", "--output", str(tmp_path / "o")]
    config, _ = parser.parse([*args, "--methods", "snapkv", "--cache-sizes", "0.5", "--metric", "qa_f1"])
    job = config.job_config()
    assert job.input == str(docs) and job.metric == "qa_f1" and [s.method for s in job.sweep] == ["none", "snapkv"]
    assert job.columns.model_fields_set == {"id", "context"}  # the user's column flags, only those
    with pytest.raises(SystemExit) as refused:  # a generated-documents option with --input: said, not ignored
        parser.parse([*args, "--tasks", "vt", "--samples", "3"])
    assert refused.value.code == 2


def test_methods_flag_keeps_variant_brackets_together(tmp_path):
    parser = OptionParser(EvalJob, prog="eval")
    config, _ = parser.parse(["--methods", "snapkv,snapkv[window=64,kernel=5],none", "--output", str(tmp_path)])
    assert config.methods == ["snapkv", "snapkv[window=64,kernel=5]", "none"]
    assert "--variant" not in parser.parser.format_help()  # set by the sweep, not a flag


@pytest.mark.slow
def test_a_small_sweep_runs_scores_and_reports(tmp_path):
    out = tmp_path / "eval"
    cmd = [
        sys.executable,
        str(ROOT / "jobs" / "eval_compression.py"),
        "--tasks",
        "niah_single_1,summary_essay",
        "--length",
        "400",
        "--samples",
        "1",
        "--methods",
        "snapkv,layer-knorm",
        "--cache-sizes",
        "0.5",
        "--summary-tokens",
        "12",
        "--max-new-tokens",
        "12",
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = pq.read_table(out / "data").to_pylist()
    assert len(rows) == 2 * 3  # 2 documents x (none + 2 settings)
    assert {r["method"] for r in rows} == {"none", "snapkv", "layer-knorm"}
    assert all(r["error"] is None and r["score"] is not None and r["answer_nll"] is not None for r in rows)
    assert {r["score"] for r in rows if r["method"] == "none" and r["task"] == "summary_essay"} == {1.0}
    report = (out / "report.md").read_text()
    assert "Answer fidelity" in report and (out / "fidelity.png").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runs"][-1]["status"] == "completed"
