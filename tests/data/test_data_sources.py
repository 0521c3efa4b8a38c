"""Readers: Parquet file and directory, JSONL with broken lines, save_to_disk, hub-name errors."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import ColumnMapping, DataSourceError, content_id, read_documents, read_table

ROWS = [
    {"doc_id": "a", "context": "Alpha text.", "question": "What is alpha?", "reference": "alpha"},
    {"doc_id": "b", "context": "Beta text.", "question": "What is beta?", "reference": "beta"},
]


def _good(table):
    return [r for r in table.to_pylist() if r["input_error"] is None]


def test_parquet_file(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    table = read_documents(tmp_path / "in.parquet")
    assert table.column("doc_id").to_pylist() == ["a", "b"]
    row = table.to_pylist()[0]
    assert row["questions"] == ["What is alpha?"] and row["question_ids"] == ["0"]
    assert row["references"] == [["alpha"]] and row["answer_prefix"] == "" and row["input_error"] is None


def test_parquet_directory_reads_all_files_in_order(tmp_path):
    (tmp_path / "part").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[1:]), tmp_path / "part" / "b.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), tmp_path / "a.parquet")
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".hidden.parquet").write_text("not parquet")
    assert read_documents(tmp_path).column("doc_id").to_pylist() == ["a", "b"]


def test_empty_directory_is_a_clear_error(tmp_path):
    with pytest.raises(DataSourceError, match="holds no Parquet or JSON-lines files"):
        read_documents(tmp_path)


def test_jsonl_with_invalid_utf8_and_invalid_json_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [
        json.dumps(ROWS[0]).encode(),
        b'{"doc_id": "x", "context": "caf\xe9", "question": "q"}',
        b"",
        b'{"doc_id": "y", "context": ',
        b"[1, 2]",
        json.dumps(ROWS[1]).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    table = read_documents(path)
    rows = table.to_pylist()
    assert table.num_rows == 5
    assert [r["doc_id"] for r in _good(table)] == ["a", "b"]
    assert _good(table)[1]["context"] == "Beta text." and _good(table)[1]["references"] == [["beta"]]
    errors = [r["input_error"] for r in rows if r["input_error"]]
    assert errors[0].startswith("line 2: invalid UTF-8")
    assert errors[1].startswith("line 4: invalid JSON")
    assert errors[2] == "line 5: expected a JSON object, got a list"
    for row in rows[1:4]:
        assert row["context"] is None and row["question_ids"] == ["0"]
    assert len({r["doc_id"] for r in rows}) == 5  # broken lines still get distinct, stable ids
    assert read_documents(path).equals(table)


def test_jsonl_type_clash_in_a_used_field_flags_only_that_line(tmp_path):
    path = tmp_path / "in.jsonl"
    rows = ROWS + [
        {"doc_id": "c", "context": 12345, "question": "q", "note": [1]},
        {"doc_id": "d", "context": "Delta.", "question": "q", "note": "text"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    table = read_documents(path).to_pylist()
    assert table[2]["input_error"] == "line 3: field 'context' is a number, expected a string like the other lines"
    assert table[2]["context"] is None
    assert [r["input_error"] for r in table if r["doc_id"] != "c"] == [None, None, None]


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert read_documents(tmp_path / "ds").column("doc_id").to_pylist() == ["a", "b"]
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:1]), "test": datasets.Dataset.from_list(ROWS[1:])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert read_documents(tmp_path / "dd").column("doc_id").to_pylist() == ["a"]
    assert read_documents(tmp_path / "dd", split="test").column("doc_id").to_pylist() == ["b"]
    with pytest.raises(DataSourceError, match="available splits: train, test"):
        read_documents(tmp_path / "dd", split="validation")


def test_hub_name_failure_is_wrapped(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataSourceError, match="not an existing file or directory.*ConnectionError: no network"):
        read_documents("someone/no-such-dataset")


def test_hub_name_is_used_when_not_a_path(monkeypatch):
    seen = {}

    def fake(name, config, split=None):
        seen.update(name=name, config=config, split=split)
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    table = read_documents("org/name", split="validation")
    assert seen == {"name": "org/name", "config": None, "split": "validation"} and table.num_rows == 2


def test_missing_paths_and_unknown_types_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="input not found"):
        read_documents(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError):
        read_documents("./data/missing")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataSourceError, match="unsupported file type '.csv'"):
        read_table(tmp_path / "x.csv")


def test_missing_ids_get_stable_content_hash(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "doc_id"} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    ids = read_documents(tmp_path / "in.parquet").column("doc_id").to_pylist()
    assert ids == [content_id("Alpha text."), content_id("Beta text.")]
    import hashlib

    assert ids[0] == hashlib.sha1(b"Alpha text.").hexdigest()[:16]
    assert read_documents(tmp_path / "in.parquet").column("doc_id").to_pylist() == ids


def test_mapping_renames_columns(tmp_path):
    rows = [
        {"id": 7, "text": "Some text.", "q": "Why?", "gold": ["x", "y"], "prefix": "Because", "qid": "why", "limit": 12}
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    mapping = ColumnMapping(
        id="id",
        context="text",
        question="q",
        reference="gold",
        answer_prefix="prefix",
        question_id="qid",
        max_new_tokens="limit",
    )
    row = read_documents(tmp_path / "in.parquet", mapping).to_pylist()[0]
    assert row == {
        "doc_id": "7",
        "context": "Some text.",
        "questions": ["Why?"],
        "question_ids": ["why"],
        "answer_prefix": "Because",
        "references": [["x", "y"]],
        "max_new_tokens": 12,
        "input_error": None,
        "task": None,
    }


def test_jsonl_content_errors_name_the_line_and_odd_lines_do_not_crash(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b"\n".join(
            [
                json.dumps(ROWS[0]).encode(),
                b"",
                b'{"doc_id": "q", "context": "text", "question": null}',
                b'{"doc_id": "s", "context": "bad \\ud800 escape", "question": "q"}',
                b"null",
            ]
        )
    )
    rows = {r["doc_id"]: r for r in read_documents(path).to_pylist()}
    assert rows["a"]["input_error"] is None
    assert rows["q"]["input_error"] == "line 3: question is null or missing" and rows["q"]["context"] == "text"
    errors = sorted(r["input_error"] for r in rows.values() if r["input_error"] and r["doc_id"] != "q")
    assert errors == [
        "line 4: invalid Unicode (a lone surrogate \\u escape)",
        "line 5: expected a JSON object, got a null",
    ]


def test_json_array_file_and_all_lines_broken(tmp_path):
    (tmp_path / "in.json").write_text(json.dumps(ROWS))
    assert read_documents(tmp_path / "in.json").column("doc_id").to_pylist() == ["a", "b"]
    (tmp_path / "bad.jsonl").write_bytes(b"{oops\n\xff\xfe\n")
    table = read_documents(tmp_path / "bad.jsonl")
    assert table.num_rows == 2 and table.column("context").null_count == 2
    assert table.column("input_error").to_pylist()[0].startswith("line 1: invalid JSON")


def test_read_documents_rejects_duplicate_ids_unless_asked_not_to(tmp_path):
    rows = ROWS + [{"doc_id": "a", "context": "Another alpha.", "question": "?"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    with pytest.raises(ValueError, match=r"duplicate doc_id.*'a' \(2 rows\)"):
        read_documents(tmp_path / "in.parquet")
    assert read_documents(tmp_path / "in.parquet", check_duplicates=False).num_rows == 3
