"""The actor class called directly (no Ray): one row per question, errors as rows, never raises."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline import hooks
from pipeline.data import DOCUMENT_SCHEMA, OUTPUT_SCHEMA, normalise_batch
from pipeline.distributed.predictor import Predictor, resolve_factory
from pipeline.distributed.rows import PACKED, unpack
from pipeline.eval.scoring import score_answer
from pipeline.eval.sweep import sweep_settings
from pipeline.kv.config import CompressionConfig
from tests.distributed.conftest import TINY_FACTORY, small_docs
from tests.faults import Faults, InjectedFault

JOB_FIELDS = {
    "run_id": "r1",
    "job": "longdoc_qa",
    "model": "tiny-llama",
    "method": "snapkv",
    "cache_size": 0.5,
    "budget": None,
}


def _predictor(**generation):
    return Predictor(
        model={"name": "tiny-llama"},
        compression={"method": "snapkv", "cache_size": 0.5, "window": 4, "kernel": 3},
        generation={"max_new_tokens": 2, **generation},
        job_fields=JOB_FIELDS,
        engine_factory=TINY_FACTORY,
    )


@pytest.fixture
def faults():
    """``faults(**directives)`` installs the test hook in this process; removed after the test."""
    yield lambda **directives: hooks.install(Faults(directives))
    hooks.install(None)


@pytest.fixture(scope="module")
def predictor():
    return _predictor(batch_size=2)


def _batch(docs) -> pa.Table:
    return pa.Table.from_pylist(docs, schema=DOCUMENT_SCHEMA)


def _answer(predictor, batch: pa.Table) -> pa.Table:
    """Every row the actor yields for ``batch`` (one packed document at a time, in the order they
    finish), unpacked as the driver does, documents in input order."""
    tables = [unpack(t) for t in predictor(batch)]
    place = {doc_id: i for i, doc_id in enumerate(batch.column("doc_id").to_pylist())}
    tables.sort(key=lambda t: place[t.column("doc_id")[0].as_py()])
    return pa.concat_tables(tables)


def test_one_row_per_question_with_identity_columns(predictor):
    docs = small_docs(3)
    out = _answer(predictor, _batch(docs))
    assert out.schema.equals(OUTPUT_SCHEMA, check_metadata=True)
    keys = list(zip(out.column("doc_id").to_pylist(), out.column("question_id").to_pylist()))
    assert keys == [(d["doc_id"], q) for d in docs for q in d["question_ids"]]
    for row in out.to_pylist():
        assert row["error"] is None and row["run_id"] == "r1" and row["method"] == "snapkv"
        assert row["cache_size"] == 0.5 and row["budget"] is None and row["score"] is None
        assert row["reference"] and row["kv_bytes_kept"] < row["kv_bytes_full"]


def test_input_errors_become_error_rows_without_generation(predictor):
    raw = pa.Table.from_pylist(
        [
            {"doc_id": "ok", "context": "A short text about a harbour.", "question": "What?"},
            {"doc_id": "bad", "context": "", "question": "What?"},
        ]
    )
    docs = normalise_batch(raw).to_pylist() + [
        {
            "doc_id": "mismatch",
            "context": "text",
            "questions": ["a", "b"],
            "question_ids": ["0", "1"],
            "answer_prefix": "",
            "references": None,
            "max_new_tokens": None,
            "input_error": "line 3: broken",
        }
    ]
    out = _answer(predictor, _batch(docs)).to_pylist()
    assert [(r["doc_id"], r["question_id"]) for r in out] == [
        ("ok", "0"),
        ("bad", "0"),
        ("mismatch", "0"),
        ("mismatch", "1"),
    ]
    assert out[0]["error"] is None
    assert "context is empty" in out[1]["error"] and out[1]["prediction"] is None
    assert out[2]["error"] == out[3]["error"] == "line 3: broken"


def test_an_exception_in_one_document_is_isolated(faults):
    faults(error_doc_ids=["qa-s1-0001-multikey"])
    predictor = _predictor(batch_size=4)
    docs = small_docs(3)
    out = _answer(predictor, _batch(docs)).to_pylist()
    errors = {r["doc_id"]: r["error"] for r in out}
    assert "InjectedFault" in errors.pop("qa-s1-0001-multikey")
    assert all(e is None for e in errors.values()) and len(out) == 4


def test_engine_that_returns_nothing_or_raises_still_yields_one_row_per_question(predictor):
    class Broken:
        def generate(self, requests):
            if len(requests) > 1:
                raise RuntimeError("batch exploded")
            return []  # a buggy engine: no answers at all

    docs = small_docs(2)
    original = predictor.engine
    predictor.engine = Broken()
    try:
        out = _answer(predictor, _batch(docs)).to_pylist()
    finally:
        predictor.engine = original
    assert [(r["doc_id"], r["question_id"]) for r in out] == [(d["doc_id"], q) for d in docs for q in d["question_ids"]]
    assert all(r["error"] for r in out)


def test_raise_after_batches_hook(faults):
    faults(raise_after_batches=1)
    predictor = _predictor()
    batch = _batch(small_docs(1))
    assert _answer(predictor, batch).num_rows == 1
    with pytest.raises(InjectedFault):
        _answer(predictor, batch)


def test_factory_resolution_errors_are_clear():
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_factory("tests.distributed.nope:factory")
    assert callable(resolve_factory(None))


def test_sweep_rows_per_setting_with_task_and_score():
    settings = sweep_settings(["snapkv", "criticalkv-snapkv"], [0.3, 1.0], CompressionConfig(window=4, kernel=3))
    base = small_docs(2)
    for doc in base:
        doc["task"] = "niah_single_1"
        doc["references"] = [["zzz-not-there"] for _ in doc["questions"]]
    predictor = Predictor(
        model={"name": "tiny-llama"},
        compression=settings[0].model_dump(mode="json"),
        generation={"max_new_tokens": 2, "batch_size": 2},
        job_fields={**JOB_FIELDS, "job": "eval_compression"},
        engine_factory=TINY_FACTORY,
        sweep=[s.model_dump(mode="json") for s in settings],
        score=score_answer,
    )
    out = _answer(predictor, _batch(base)).to_pylist()
    assert len(out) == sum(len(d["questions"]) for d in base) * len(settings)
    assert {(r["method"], r["cache_size"]) for r in out} == {("none", 1.0), ("snapkv", 0.3), ("criticalkv-snapkv", 0.3)}
    for row in out:
        assert row["error"] is None and row["task"] == "niah_single_1" and row["score"] == 0.0
        assert row["question_id"].endswith(f"|{row['method']}|{row['cache_size']:g}")
        full = row["kv_bytes_full"]
        assert row["kv_bytes_kept"] / full == pytest.approx(1.008 if row["method"] == "none" else 0.3, abs=0.03)


def test_sweep_variants_answer_as_their_own_runs_under_their_labels():
    """Variants of one method (other knob values) swept from one prefill answer and keep exactly what
    a job run with that configuration alone does; their rows carry the variant label."""
    settings = sweep_settings(
        ["snapkv", "snapkv[window=8,kernel=1,pooling=avg]"], [0.4], CompressionConfig(window=4, kernel=3)
    )
    docs = small_docs(2)

    def rows(compression, sweep=None):
        predictor = Predictor(
            model={"name": "tiny-llama"},
            compression=compression.model_dump(mode="json"),
            generation={"max_new_tokens": 4, "batch_size": 2},
            job_fields={**JOB_FIELDS, "job": "eval_compression"} if sweep else JOB_FIELDS,
            engine_factory=TINY_FACTORY,
            sweep=[s.model_dump(mode="json") for s in sweep] if sweep else None,
        )
        return _answer(predictor, _batch(docs)).to_pylist()

    swept = rows(settings[0], settings)
    assert {r["method"] for r in swept} == {"none", "snapkv", "snapkv[kernel=1,pooling=avg,window=8]"}
    for setting in settings[1:]:
        mine = [r for r in swept if r["method"] == setting.label]
        alone = rows(setting.with_method(variant=None))
        assert [r["prediction"] for r in mine] == [r["prediction"] for r in alone]
        assert [r["kv_entries_kept"] for r in mine] == [r["kv_entries_kept"] for r in alone]
        assert all(r["question_id"].endswith(f"|{setting.label}|0.4") for r in mine)
    plain, variant = ([r["kv_entries_kept"] for r in swept if r["method"] == s.label] for s in settings[1:])
    assert plain == variant  # same budget: the kept counts agree
    answers = [[r["prediction"] for r in swept if r["method"] == s.label] for s in settings[1:]]
    assert answers[0] != answers[1]  # ... and other entries: the variant is not the plain method


def test_oom_rows_are_recorded_or_retried_smaller(faults):
    faults(oom=["d0"], oom_above=0.3)
    docs = small_docs(3)
    docs[0]["doc_id"] = "d0"

    def run(retry):
        p = Predictor(
            model={"name": "tiny-llama"},
            compression={"method": "snapkv", "cache_size": 0.5, "window": 4, "kernel": 3},
            generation={"max_new_tokens": 2, "batch_size": 3},
            job_fields=JOB_FIELDS,
            engine_factory=TINY_FACTORY,
            oom_retry_cache_size=retry,
        )
        return _answer(p, _batch(docs)).to_pylist()

    plain = run(None)
    assert all("OutOfMemoryError" in r["error"] for r in plain if r["doc_id"] == "d0")
    assert all(r["error"] is None for r in plain if r["doc_id"] != "d0")
    retried = run(0.2)
    assert all(r["error"] is None for r in retried)
    assert {r["cache_size"] for r in retried if r["doc_id"] == "d0"} == {0.2}
    assert {r["cache_size"] for r in retried if r["doc_id"] != "d0"} == {0.5}


def test_sweep_scores_summaries_against_the_full_cache_answer():
    settings = sweep_settings(["snapkv"], [0.3, 1.0], CompressionConfig(window=4, kernel=3))
    docs = small_docs(1)
    docs[0]["task"] = "summary_essay"
    docs[0]["references"] = None
    predictor = Predictor(
        model={"name": "tiny-llama"},
        compression=settings[0].model_dump(mode="json"),
        generation={"max_new_tokens": 4},
        job_fields={**JOB_FIELDS, "job": "eval_compression"},
        engine_factory=TINY_FACTORY,
        sweep=[s.model_dump(mode="json") for s in settings],
        score=score_answer,
    )
    rows = {(r["method"], r["question_id"].split("|")[0]): r for r in _answer(predictor, _batch(docs)).to_pylist()}
    for (method, _), row in rows.items():
        assert row["error"] is None and row["score"] is not None and 0.0 <= row["score"] <= 1.0
        assert row["answer_nll"] is not None and row["answer_nll_delta"] is not None
        if method == "none":
            assert row["score"] == 1.0 and row["answer_nll_delta"] == 0.0


def test_source_fingerprint_follows_the_code(tmp_path):
    from pipeline.distributed.predictor import check_same_code, package_fingerprint, source_fingerprint

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not code")
    first = source_fingerprint(tmp_path / "pkg")
    (tmp_path / "pkg" / "notes.txt").write_text("still not code")
    assert source_fingerprint(tmp_path / "pkg") == first
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert source_fingerprint(tmp_path / "pkg") != first
    check_same_code(package_fingerprint())  # the same code: nothing happens
    check_same_code(None)  # not asked
    with pytest.raises(RuntimeError, match="imported the pipeline package from .* differs from the driver's"):
        check_same_code("0" * 16)


def test_each_document_leaves_the_call_packed_as_soon_as_it_is_answered():
    """The Ray entry point yields one packed table per document in the order documents finish (the
    1-token answer before the 20-token one that came first), each unpacking to that document's rows;
    _answer() gives the same rows in input order."""
    predictor = _predictor(batch_size=2, max_new_tokens=20)
    docs = small_docs(2)
    docs[0]["max_new_tokens"], docs[1]["max_new_tokens"] = 20, 1
    stream = predictor(_batch(docs))
    first = next(stream)
    assert first.column_names == [PACKED] and first.num_rows == 1
    assert set(unpack(first).column("doc_id").to_pylist()) == {docs[1]["doc_id"]}
    rest = [unpack(t) for t in stream]
    assert [set(t.column("doc_id").to_pylist()) for t in rest] == [{docs[0]["doc_id"]}]
    whole = _answer(predictor, _batch(docs))
    assert whole.schema.equals(OUTPUT_SCHEMA, check_metadata=True)
    assert list(zip(whole.column("doc_id").to_pylist(), whole.column("question_id").to_pylist())) == [
        (d["doc_id"], q) for d in docs for q in d["question_ids"]
    ]
    streamed = pa.concat_tables([unpack(first), *rest]).to_pylist()
    key = lambda r: (r["doc_id"], r["question_id"], r["prediction"], r["error"])  # noqa: E731
    assert sorted(map(key, streamed)) == sorted(map(key, whole.to_pylist()))


def test_actors_wait_passively_for_openmp_unless_the_driver_says_otherwise(monkeypatch):
    """The engine answers in a thread of the actor (streaming); OpenMP's active waiting slowed that
    thread's CPU work, so the actors get OMP_WAIT_POLICY=PASSIVE, or the driver's own value."""
    from pipeline.distributed.dataset import actor_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert actor_env() == {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert actor_env() == {"OMP_WAIT_POLICY": "ACTIVE"}
