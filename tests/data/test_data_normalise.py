"""Normalisation: mapping errors, grouping, per-row input errors, duplicates, Ray-style batches."""

import pyarrow as pa
import pytest

from pipeline.data import DOCUMENT_SCHEMA, ColumnMapping, check_duplicate_ids, normalise_batch


def _table(rows):
    return pa.Table.from_pylist(rows)


def test_missing_required_columns_list_the_available_ones():
    table = _table([{"text": "abc", "q": "why?"}])
    with pytest.raises(ValueError, match=r"context='context'.*available columns: text, q"):
        normalise_batch(table)
    with pytest.raises(ValueError, match=r"question='question'.*available columns: text, q"):
        normalise_batch(table, ColumnMapping(context="text"))
    with pytest.raises(ValueError, match=r"id='doc'.*available columns: text, q"):
        normalise_batch(table, ColumnMapping(id="doc", context="text", question="q"))
    with pytest.raises(ValueError, match=r"reference='gold'"):
        normalise_batch(table, ColumnMapping(context="text", question="q", reference="gold"))


def test_mapping_validation():
    with pytest.raises(ValueError, match="either question"):
        ColumnMapping(question="q", questions="qs")
    with pytest.raises(ValueError, match="must not be empty"):
        ColumnMapping(context=" ")
    with pytest.raises(ValueError):
        ColumnMapping(contxt="x")


def test_question_rows_are_grouped_into_documents():
    rows = [
        {"doc_id": "d1", "context": "Long text one.", "question": "Q1?", "question_id": "a", "reference": "r1"},
        {"doc_id": "d2", "context": "Long text two.", "question": "Q3?", "question_id": "c", "reference": None},
        {"doc_id": "d1", "context": "Long text one.", "question": "Q2?", "question_id": "b", "reference": "r2"},
    ]
    out = normalise_batch(_table(rows)).to_pylist()
    assert [d["doc_id"] for d in out] == ["d1", "d2"]
    assert out[0]["questions"] == ["Q1?", "Q2?"] and out[0]["question_ids"] == ["a", "b"]
    assert out[0]["references"] == [["r1"], ["r2"]] and out[1]["references"] is None
    assert all(d["input_error"] is None for d in out)


def test_same_id_different_context_is_not_merged_and_is_detected():
    rows = [
        {"doc_id": "d", "context": "one", "question": "q"},
        {"doc_id": "d", "context": "two", "question": "q"},
        {"doc_id": "e", "context": "x", "question": "q"},
        {"doc_id": "e", "context": "y", "question": "q"},
        {"doc_id": "f", "context": "z", "question": "q"},
    ]
    out = normalise_batch(_table(rows))
    assert out.num_rows == 5
    with pytest.raises(ValueError, match=r"2 duplicate doc_id\(s\).*'d' \(2 rows\), 'e' \(2 rows\)"):
        check_duplicate_ids(out)
    check_duplicate_ids(out.slice(4))


def test_rows_without_ids_group_by_context_hash():
    rows = [
        {"context": "same", "question": "q1"},
        {"context": "same", "question": "q2"},
        {"context": "other", "question": "q3"},
    ]
    out = normalise_batch(_table(rows)).to_pylist()
    assert [d["questions"] for d in out] == [["q1", "q2"], ["q3"]]
    assert [d["question_ids"] for d in out] == [["0", "1"], ["0"]]


def test_bad_rows_carry_input_error_and_good_rows_are_intact():
    rows = [
        {"doc_id": "good", "context": "Fine text.", "question": "Why?"},
        {"doc_id": "null", "context": None, "question": "Why?"},
        {"doc_id": "empty", "context": "", "question": "Why?"},
        {"doc_id": "blank", "context": " \n\t", "question": "Why?"},
        {"doc_id": "noq", "context": "Text.", "question": None},
        {"doc_id": "good2", "context": "More text.", "question": "How?"},
    ]
    out = {d["doc_id"]: d for d in normalise_batch(_table(rows), row_offset=0).to_pylist()}
    assert out["good"] == {
        "doc_id": "good",
        "context": "Fine text.",
        "questions": ["Why?"],
        "question_ids": ["0"],
        "answer_prefix": "",
        "references": None,
        "max_new_tokens": None,
        "input_error": None,
        "task": None,
    }
    assert out["good2"]["input_error"] is None and out["good2"]["context"] == "More text."
    assert out["null"]["input_error"] == "row 1: context is null or missing" and out["null"]["context"] is None
    assert out["empty"]["input_error"] == "row 2: context is empty"
    assert out["blank"]["input_error"] == "row 3: context is only whitespace"
    assert out["noq"]["input_error"] == "row 4: question is null or missing"
    assert out["noq"]["question_ids"] == ["0"]  # the driver can still emit one error row


def test_non_string_context_column_does_not_raise():
    out = normalise_batch(_table([{"doc_id": "n", "context": 42, "question": "q"}])).to_pylist()
    assert out[0]["input_error"] == "context is an int, expected a string" and out[0]["context"] is None


def test_list_questions_shape_and_its_errors():
    rows = [
        {"doc_id": "a", "context": "ctx a", "questions": ["q1", "q2"], "references": [["x"], ["y", "z"]]},
        {"doc_id": "b", "context": "ctx b", "questions": [], "references": None},
        {"doc_id": "c", "context": "ctx c", "questions": ["ok", None], "references": None},
        {"doc_id": "d", "context": "ctx d", "questions": ["q"], "references": [["only"]]},
    ]
    out = {d["doc_id"]: d for d in normalise_batch(_table(rows)).to_pylist()}
    assert out["a"]["questions"] == ["q1", "q2"] and out["a"]["question_ids"] == ["0", "1"]
    assert out["a"]["references"] == [["x"], ["y", "z"]] and out["a"]["input_error"] is None
    assert "questions is an empty list" in out["b"]["input_error"]
    assert out["c"]["input_error"] == "question 1 is null or missing"
    assert out["d"]["input_error"] is None


def test_duplicate_question_ids_and_conflicting_prefixes_are_row_errors():
    rows = [
        {"doc_id": "d", "context": "c", "question": "q1", "question_id": "x", "answer_prefix": "A"},
        {"doc_id": "d", "context": "c", "question": "q2", "question_id": "x", "answer_prefix": "B"},
    ]
    (doc,) = normalise_batch(_table(rows)).to_pylist()
    assert "disagree on answer_prefix: 'A' vs 'B'" in doc["input_error"]
    assert "duplicate question_id(s) 'x'" in doc["input_error"]


def test_bad_max_new_tokens_is_a_row_error():
    rows = [
        {"doc_id": "d", "context": "c", "question": "q", "max_new_tokens": 0},
        {"doc_id": "e", "context": "c2", "question": "q", "max_new_tokens": 8},
    ]
    out = normalise_batch(_table(rows)).to_pylist()
    assert out[0]["input_error"] == "max_new_tokens must be a positive integer, got 0"
    assert out[1]["max_new_tokens"] == 8 and out[1]["input_error"] is None


def test_normalised_table_is_a_fixed_point_and_record_batches_work():
    rows = [
        {"doc_id": "d", "context": "c", "question": "q", "reference": ["r"]},
        {"doc_id": "e", "context": None, "question": "q"},
    ]
    once = normalise_batch(_table(rows))
    assert once.schema.equals(DOCUMENT_SCHEMA)
    assert normalise_batch(once).equals(once)
    assert normalise_batch(_table(rows).to_batches()[0]).equals(once)


def test_empty_batch_keeps_the_schema():
    empty = pa.table(
        {
            "doc_id": pa.array([], pa.string()),
            "context": pa.array([], pa.string()),
            "question": pa.array([], pa.string()),
        }
    )
    out = normalise_batch(empty)
    assert out.num_rows == 0 and out.schema.equals(DOCUMENT_SCHEMA)


def test_list_references_must_match_the_questions():
    rows = [
        {"doc_id": "a", "context": "c", "questions": ["q1", "q2"], "references": [["x"], ["y"], ["z"]]},
        {"doc_id": "b", "context": "c", "questions": ["q1", "q2"], "references": ["x", "y"]},
        {"doc_id": "c", "context": "c", "questions": ["q1"], "references": ["x", "y"]},
    ]
    out = [normalise_batch(_table([row])).to_pylist()[0] for row in rows]  # differently typed columns
    assert out[0]["input_error"] == "references must hold one entry per question (2), got a list of 3"
    assert out[1]["references"] == [["x"], ["y"]] and out[1]["input_error"] is None
    assert out[2]["references"] == [["x", "y"]] and out[2]["input_error"] is None


@pytest.mark.slow
def test_normalise_batch_inside_ray_map_batches():
    import ray  # a hard dependency: missing, the test must fail, not skip

    from pipeline.data import question_rows, sample_qa_documents

    docs = sample_qa_documents(4, 200)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ds = ray.data.from_arrow(pa.Table.from_pylist(question_rows(docs))).map_batches(
            normalise_batch, fn_kwargs={"mapping": ColumnMapping()}, batch_format="pyarrow", batch_size=100
        )
        out = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    finally:
        ray.shutdown()
    expected = pa.Table.from_pylist(docs, schema=DOCUMENT_SCHEMA)
    assert out.sort_by("doc_id").equals(expected.sort_by("doc_id"))
