"""Versioned Arrow schemas: the output contract (one row per question) and normalised documents.

``OUTPUT_SCHEMA`` is the output contract (docs/ARCHITECTURE.md): its column names and types only
change together with a bump of :data:`SCHEMA_VERSION`, which is stored in the schema metadata
(key ``b"pipeline.schema_version"``) and therefore in every Parquet file written with it.

Nullability: ``doc_id`` and ``question_id`` are required (every row names what it answers); every
other column is nullable, because a failed row carries its ``error`` but no prediction, timings or
memory figures, and ``budget`` / ``reference`` / ``score`` exist only for some runs and inputs.

``DOCUMENT_SCHEMA`` is the shape :mod:`pipeline.data.sources` normalises every input to (one row per
document, its questions in list columns); it is not versioned because it never leaves a run.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping

import pyarrow as pa

SCHEMA_VERSION = 4  # 2: answer_nll, answer_nll_delta (answer fidelity of sweeps); 3: kv_bytes_reserved, kv_bytes_used;
# 4: input_hash, finish_reason, decode_batch
SCHEMA_VERSION_KEY = b"pipeline.schema_version"

# Who fills each column (the single place the output contract is written down):
#   key      -- the row's identity within a run's output (doc_id, question_id)
#   job      -- the job, the same on every row of a run (run_id, job, model)
#   setting  -- the compression setting the row was answered with (method, cache_size, budget)
#   input    -- copied from the input document (task, reference)
#   answer   -- the engine's :class:`pipeline.engine.types.Answer` (prediction, tokens, cache, time, memory, error)
#   eval     -- scoring against the reference (score)
KEY, JOB, SETTING, INPUT, ANSWER, EVAL = "key", "job", "setting", "input", "answer", "eval"
_OUTPUT_FIELDS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("doc_id", pa.string(), KEY),
    ("question_id", pa.string(), KEY),
    ("run_id", pa.string(), JOB),
    ("job", pa.string(), JOB),
    ("task", pa.string(), INPUT),  # evaluation task (RULER task, LongBench dataset); null for plain QA jobs
    ("model", pa.string(), JOB),
    ("method", pa.string(), SETTING),
    ("cache_size", pa.float64(), SETTING),
    ("budget", pa.int64(), SETTING),
    ("prediction", pa.string(), ANSWER),
    ("reference", pa.list_(pa.string()), INPUT),
    # what the row was computed from (context, question, answer prefix, limit): a rerun warns when it changed
    ("input_hash", pa.string(), INPUT),
    ("score", pa.float64(), EVAL),
    ("context_tokens", pa.int64(), ANSWER),
    ("question_tokens", pa.int64(), ANSWER),
    ("generated_tokens", pa.int64(), ANSWER),
    # why the answer ended: stop (EOS), length (max_new_tokens; text cut there), sentence (max_new_tokens,
    # text cut back to its last complete sentence by end_at_sentence)
    ("finish_reason", pa.string(), ANSWER),
    ("truncated_tokens", pa.int64(), ANSWER),
    ("kv_entries_full", pa.int64(), ANSWER),
    ("kv_entries_kept", pa.int64(), ANSWER),
    ("kv_bytes_full", pa.int64(), ANSWER),
    ("kv_bytes_kept", pa.int64(), ANSWER),
    # the cache while answering: allocated (incl. room reserved for the question and answer) and filled
    ("kv_bytes_reserved", pa.int64(), ANSWER),
    ("kv_bytes_used", pa.int64(), ANSWER),
    ("ttft_s", pa.float64(), ANSWER),
    ("compress_s", pa.float64(), ANSWER),
    ("decode_s", pa.float64(), ANSWER),
    ("decode_ms_per_token", pa.float64(), ANSWER),
    # mean rows decoded together over the steps decode_s covers (1: alone; the batch's occupancy)
    ("decode_batch", pa.float64(), ANSWER),
    ("peak_memory_bytes", pa.int64(), ANSWER),
    ("device", pa.string(), ANSWER),
    # fidelity (sweeps): mean NLL of the full cache's answer under this row's cache, and minus the full cache's
    ("answer_nll", pa.float64(), ANSWER),
    ("answer_nll_delta", pa.float64(), ANSWER),
    ("error", pa.string(), ANSWER),
)

OUTPUT_SCHEMA: pa.Schema = pa.schema(
    [pa.field(name, dtype, nullable=role != KEY) for name, dtype, role in _OUTPUT_FIELDS],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)
OUTPUT_COLUMNS: tuple[str, ...] = tuple(OUTPUT_SCHEMA.names)


def columns_filled_by(role: str) -> tuple[str, ...]:
    """Output column names filled by ``role`` (``KEY``, ``JOB``, ``SETTING``, ``INPUT``, ``ANSWER``, ``EVAL``)."""
    return tuple(name for name, _, r in _OUTPUT_FIELDS if r == role)


def python_type(column: str) -> type:
    """The Python type of an output column's values (str, int, float or list)."""
    dtype = OUTPUT_SCHEMA.field(column).type
    if pa.types.is_list(dtype):
        return list
    return {pa.string(): str, pa.int64(): int, pa.float64(): float}[dtype]


DOCUMENT_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("context", pa.string()),  # null when the row could not be read (see input_error)
        pa.field("questions", pa.list_(pa.string()), nullable=False),
        pa.field("question_ids", pa.list_(pa.string()), nullable=False),
        pa.field("answer_prefix", pa.string()),
        pa.field("references", pa.list_(pa.list_(pa.string()))),
        pa.field("max_new_tokens", pa.int64()),
        pa.field("input_error", pa.string()),  # null for good rows
        pa.field("task", pa.string()),  # optional evaluation task name, copied to the output rows
    ]
)
DOCUMENT_COLUMNS: tuple[str, ...] = tuple(DOCUMENT_SCHEMA.names)


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _coerce(value: object, dtype: pa.DataType) -> object:
    """One Python value converted for ``dtype``; raises TypeError/ValueError when it does not fit."""
    if value is None:
        return None
    if pa.types.is_string(dtype):
        if isinstance(value, str):
            return value
    elif pa.types.is_int64(dtype):
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            if math.isfinite(float(value)) and float(value).is_integer():
                return int(value)
            raise ValueError(f"{_describe(value)} is not a whole number")
    elif pa.types.is_float64(dtype):
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
    elif pa.types.is_list(dtype):
        if isinstance(value, str):  # a single reference string is a one-element list
            value = [value]
        if isinstance(value, (list, tuple)):
            return [_coerce(item, dtype.value_type) for item in value]
    raise TypeError(f"{_describe(value)} does not fit type {dtype}")


def rows_to_table(rows: Iterable[Mapping[str, object]]) -> pa.Table:
    """Build an :data:`OUTPUT_SCHEMA` table from result rows (e.g. ``Answer.as_row()`` dicts).

    Columns a row does not mention are null. Values are cast to the contract types: integers and
    whole-number floats for int64 columns, any real number for float64 columns, a plain string or a
    list of strings for ``reference``; NumPy scalars are accepted. Raises ``ValueError`` naming
    every unknown column (so a typo never disappears silently), a value that does not fit its
    column (with the row index), or a row without ``doc_id`` / ``question_id``.
    """
    rows = list(rows)
    unknown = sorted({key for row in rows for key in row} - set(OUTPUT_COLUMNS))
    if unknown:
        raise ValueError(
            f"unknown output column(s): {', '.join(unknown)}; the output schema (version "
            f"{SCHEMA_VERSION}) has: {', '.join(OUTPUT_COLUMNS)}"
        )
    arrays = []
    for field in OUTPUT_SCHEMA:
        values = []
        for index, row in enumerate(rows):
            try:
                values.append(_coerce(row.get(field.name), field.type))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"row {index}, column {field.name!r}: {exc}") from None
        if not field.nullable:  # the key columns
            missing = [index for index, value in enumerate(values) if value is None]
            if missing:
                raise ValueError(
                    f"column {field.name!r} is required but missing or null in row(s) "
                    f"{', '.join(map(str, missing[:20]))}{' ...' if len(missing) > 20 else ''}"
                )
        arrays.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(arrays, schema=OUTPUT_SCHEMA)


def empty_table() -> pa.Table:
    """A table with the output schema (metadata included) and no rows."""
    return OUTPUT_SCHEMA.empty_table()


def schema_version(schema_or_table: pa.Schema | pa.Table) -> int | None:
    """The output schema version recorded in a schema's metadata, or None when it has none."""
    schema = schema_or_table.schema if isinstance(schema_or_table, pa.Table) else schema_or_table
    raw = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    return int(raw) if raw is not None else None


def check_output_table(table: pa.Table) -> None:
    """Raise ``ValueError`` unless ``table`` (e.g. read back from Parquet) follows this version.

    Checks the recorded version, then that every contract column is there with its type; extra
    columns are reported too, so readers (report, eval) fail early with one clear message.
    """
    version = schema_version(table)
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"output schema version {version} does not match this pipeline's version "
            f"{SCHEMA_VERSION}" + (" (no version in the metadata)" if version is None else "")
        )
    problems = []
    for field in OUTPUT_SCHEMA:
        if field.name not in table.column_names:
            problems.append(f"missing column {field.name!r}")
        elif not table.schema.field(field.name).type.equals(field.type):
            found = table.schema.field(field.name).type
            problems.append(f"column {field.name!r} is {found}, expected {field.type}")
    extra = [name for name in table.column_names if name not in OUTPUT_COLUMNS]
    if extra:
        problems.append(f"unknown column(s) {', '.join(extra)}")
    if problems:
        raise ValueError("output table does not follow the output schema: " + "; ".join(problems))
