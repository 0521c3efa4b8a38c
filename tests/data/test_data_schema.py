"""Output schema: contract columns and types, round trip through Parquet, clear rejections."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import (
    OUTPUT_COLUMNS,
    OUTPUT_SCHEMA,
    SCHEMA_VERSION,
    check_output_table,
    empty_table,
    rows_to_table,
    schema_version,
)
from pipeline.engine.types import Answer

EXPECTED = {
    "doc_id": pa.string(),
    "question_id": pa.string(),
    "run_id": pa.string(),
    "job": pa.string(),
    "task": pa.string(),
    "model": pa.string(),
    "method": pa.string(),
    "cache_size": pa.float64(),
    "budget": pa.int64(),
    "prediction": pa.string(),
    "reference": pa.list_(pa.string()),
    "input_hash": pa.string(),
    "score": pa.float64(),
    "context_tokens": pa.int64(),
    "question_tokens": pa.int64(),
    "generated_tokens": pa.int64(),
    "finish_reason": pa.string(),
    "truncated_tokens": pa.int64(),
    "kv_entries_full": pa.int64(),
    "kv_entries_kept": pa.int64(),
    "kv_bytes_full": pa.int64(),
    "kv_bytes_kept": pa.int64(),
    "kv_bytes_reserved": pa.int64(),
    "kv_bytes_used": pa.int64(),
    "ttft_s": pa.float64(),
    "compress_s": pa.float64(),
    "decode_s": pa.float64(),
    "decode_ms_per_token": pa.float64(),
    "decode_batch": pa.float64(),
    "peak_memory_bytes": pa.int64(),
    "device": pa.string(),
    "answer_nll": pa.float64(),
    "answer_nll_delta": pa.float64(),
    "error": pa.string(),
}


def test_schema_has_exactly_the_contract_columns_and_version():
    assert SCHEMA_VERSION == 4
    assert list(OUTPUT_COLUMNS) == list(EXPECTED)
    for name, dtype in EXPECTED.items():
        assert OUTPUT_SCHEMA.field(name).type.equals(dtype), name
    assert schema_version(OUTPUT_SCHEMA) == 4
    for name in ("budget", "reference", "score", "prediction", "error"):
        assert OUTPUT_SCHEMA.field(name).nullable


def test_round_trip_through_parquet_keeps_types_values_and_version(tmp_path):
    answer = Answer(
        doc_id="d1",
        question_id="0",
        prediction="1234567",
        context_tokens=900,
        question_tokens=20,
        generated_tokens=5,
        kv_entries_full=100,
        kv_entries_kept=20,
        kv_bytes_full=4096,
        kv_bytes_kept=820,
        ttft_s=0.5,
        compress_s=0.01,
        decode_s=0.2,
        decode_ms_per_token=40.0,
        peak_memory_bytes=10**9,
        device="cpu",
    )
    row = answer.as_row() | {
        "run_id": "r",
        "job": "qa",
        "model": "m",
        "method": "criticalkv-snapkv",
        "cache_size": 0.2,
        "reference": ["1234567"],
        "score": 1.0,
    }
    failed = {"doc_id": "d2", "question_id": "0", "error": "ValueError: boom", "budget": np.int64(128)}
    table = rows_to_table([row, failed])
    assert table.schema.equals(OUTPUT_SCHEMA, check_metadata=True)
    pq.write_table(table, tmp_path / "out.parquet")
    back = pq.read_table(tmp_path / "out.parquet")
    check_output_table(back)
    # Parquet renames the list child field ("element"), so compare types, not child names
    assert back.schema.equals(OUTPUT_SCHEMA) and schema_version(back) == SCHEMA_VERSION
    got = back.to_pylist()
    assert got[0]["reference"] == ["1234567"] and got[0]["kv_bytes_kept"] == 820
    assert got[0]["ttft_s"] == 0.5 and got[0]["budget"] is None and got[0]["error"] is None
    assert got[1]["prediction"] is None and got[1]["budget"] == 128 and got[1]["error"] == "ValueError: boom"


def test_casts_numbers_and_single_reference_string():
    table = rows_to_table(
        [
            {
                "doc_id": "d",
                "question_id": "q",
                "cache_size": 1,
                "context_tokens": 3.0,
                "reference": "abc",
                "ttft_s": np.float32(0.25),
            }
        ]
    )
    row = table.to_pylist()[0]
    assert row["cache_size"] == 1.0 and row["context_tokens"] == 3 and row["reference"] == ["abc"]
    assert row["ttft_s"] == 0.25


def test_unknown_columns_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"unknown output column\(s\): predicton, zzz"):
        rows_to_table([{"doc_id": "d", "question_id": "q", "predicton": "x"}, {"zzz": 1}])


@pytest.mark.parametrize(
    "row, pattern",
    [
        ({"doc_id": "d", "question_id": "q", "context_tokens": 2.5}, "row 0, column 'context_tokens'.*whole number"),
        ({"doc_id": "d", "question_id": "q", "prediction": 7}, "row 0, column 'prediction'"),
        ({"doc_id": "d", "question_id": "q", "score": "high"}, "column 'score'"),
        ({"doc_id": "d"}, "column 'question_id' is required.*row\\(s\\) 0"),
    ],
)
def test_bad_values_are_rejected_with_column_and_row(row, pattern):
    with pytest.raises(ValueError, match=pattern):
        rows_to_table([row])


def test_empty_table_and_output_checks():
    empty = empty_table()
    assert empty.num_rows == 0 and empty.schema.equals(OUTPUT_SCHEMA, check_metadata=True)
    check_output_table(empty)
    with pytest.raises(ValueError, match="version None"):
        check_output_table(empty.replace_schema_metadata(None))
    bad = rows_to_table([{"doc_id": "d", "question_id": "q"}]).drop_columns(["score"])
    with pytest.raises(ValueError, match="missing column 'score'"):
        check_output_table(bad)


def test_answer_declares_exactly_the_engine_columns_of_the_schema():
    """``Answer`` is a plain dataclass (editors and type checkers see its fields); it must stay the
    schema's key columns then its engine-filled columns, in order, with the columns' Python types."""
    import dataclasses
    import typing

    from pipeline.data.schema import ANSWER, KEY, columns_filled_by, python_type
    from pipeline.engine.types import Answer, Setting

    names = [f.name for f in dataclasses.fields(Answer)]
    assert names == [*columns_filled_by(KEY), *columns_filled_by(ANSWER), "setting"]
    hints = typing.get_type_hints(Answer)
    for name in columns_filled_by(KEY):
        assert hints[name] is str, name
    for name in columns_filled_by(ANSWER):
        assert hints[name] == (python_type(name) | None), name
    assert hints["setting"] == (Setting | None)
    row = Answer("d", "q", prediction="x", error=None).as_row()
    assert list(row) == [*columns_filled_by(KEY), *columns_filled_by(ANSWER)] and row["prediction"] == "x"
