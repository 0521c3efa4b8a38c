"""A document that kills its worker every time (``os._exit`` while prefilling it, through the test
hook) is isolated: its rows carry the error, every other document is answered, the run ends in
bounded time with exit 3, and the manifest and the output name the document."""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
import pytest

from pipeline.apps.batch_jobs import main
from pipeline.data import write_documents
from tests.distributed.conftest import TINY_JOB_ARGS, small_docs

JOB = [*TINY_JOB_ARGS, "--max-new-tokens", "2", "--batch-size", "2", "--rows-per-file", "1"]


def _rows(out) -> list[dict]:
    return pq.read_table(out / "data").to_pylist()


@pytest.mark.parametrize(
    "poison",
    [[5], pytest.param([2, 3], marks=pytest.mark.slow)],  # about 70 s each on 2 cores
    ids=["one poison document", "two in one batch"],
)
def test_documents_that_kill_their_worker_get_error_rows_and_the_job_goes_on(
    local_ray, faults, tmp_path, capsys, poison
):
    docs = small_docs(8, seed=21)
    path = write_documents(docs, tmp_path / "in.jsonl")
    victims = [docs[i]["doc_id"] for i in poison]
    faults(crash=victims)  # no marker: it dies every time, alone or not
    t0 = time.perf_counter()
    code = main("longdoc_qa", ["--input", str(path), "--output", str(tmp_path / "out"), *JOB])
    seconds = time.perf_counter() - t0
    captured = capsys.readouterr()
    err = captured.err
    assert code == 3, err[-3000:]
    assert "documents that killed their worker every time (rows with error): " + ", ".join(victims) in captured.out
    rows = _rows(tmp_path / "out")
    by_doc: dict[str, list[dict]] = {}
    for row in rows:
        by_doc.setdefault(row["doc_id"], []).append(row)
    assert set(by_doc) == {d["doc_id"] for d in docs}  # every document has its rows, once
    assert sum(len(v) for v in by_doc.values()) == sum(len(d["question_ids"]) for d in docs)
    for doc_id, doc_rows in by_doc.items():
        errors = {r["error"] for r in doc_rows}
        if doc_id in victims:
            assert len(errors) == 1 and errors.pop().startswith("worker died: ")
        else:
            assert errors == {None}, (doc_id, errors)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    deaths = manifest["runs"][-1]["worker_deaths"]
    assert sorted(d["doc_id"] for d in deaths) == sorted(victims)
    assert all("killed its worker every time" in err for _ in victims) and "carry an error" in err
    assert seconds < 600
    # a rerun does not try them again (their rows are committed with the error) ...
    assert main("longdoc_qa", ["--input", str(path), "--output", str(tmp_path / "out"), *JOB]) == 3
    assert len(_rows(tmp_path / "out")) == len(rows)
