"""Own-data sweeps: ``jobs/eval_compression.py --input`` on a user's JSONL, with and without references
(the tiny in-code model on the module's local Ray): every setting answers every document, rows with
references are scored by ``--metric``, every compressed row carries the fidelity NLL increase, and the
report ranks the methods."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from pipeline.apps.eval_sweep import main

from .conftest import TINY_FACTORY, small_docs

DOCS = 10


def _write_jsonl(path, references: bool):
    with path.open("w") as fh:
        for doc in small_docs(DOCS, words=40, seed=5):
            row = {"id": doc["doc_id"], "text": doc["context"], "question": doc["questions"][0]}
            if references:
                row["answer"] = doc["references"][0][0]
            fh.write(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("references", [True, False], ids=["with-references", "without"])
def test_own_documents_are_swept_scored_and_ranked(local_ray, tmp_path, references):
    path = _write_jsonl(tmp_path / "mine.jsonl", references)
    out = tmp_path / "out"
    columns = ["--id-column", "id", "--context-column", "text"]
    columns += ["--reference-column", "answer"] if references else []
    tiny = ["--model", "tiny-llama", "--engine-factory", TINY_FACTORY, "--cpus-per-actor", "1"]
    sweep = ["--methods", "snapkv,criticalkv-snapkv", "--cache-sizes", "0.5", "--window", "4", "--kernel", "3"]
    code = main(["--input", str(path), *columns, *tiny, *sweep, "--max-new-tokens", "3", "--output", str(out)])
    assert code == 0
    rows = pq.read_table(out / "data").to_pylist()
    assert len(rows) == DOCS * 3 and not [r["error"] for r in rows if r["error"]]
    assert {(r["method"], r["cache_size"]) for r in rows} == {
        ("none", 1.0),
        ("snapkv", 0.5),
        ("criticalkv-snapkv", 0.5),
    }
    assert all(r["answer_nll_delta"] is not None for r in rows if r["method"] != "none")
    assert all((r["score"] is not None) == references for r in rows)  # scored only against references
    report = (out / "report.md").read_text()
    best = report.split("## Best methods per cache size")[1].split("\n## ")[0]
    assert ("## Score by method and cache size" in report) == references
    if not references:  # (the random model's answers score 0, so the scored ranking also falls back)
        assert "by the NLL increase" in best
    assert "| 0.500 | 1 |" in best and "| 0.500 | 2 |" in best and "criticalkv-snapkv" in best
