"""The input side of a batch job: where the documents come from and how they reach Ray.

Built-in samples, an input read and normalised on the driver (``load_documents``), or a Parquet
input that Ray reads and normalises itself (``check_ray_input`` checks its schema first);
``choose_normalise`` picks between the two (see :mod:`pipeline.distributed.driver`, step 2).
Summaries turn the instruction into every document's only question. Local paths and
``s3://`` / ``gs://`` URIs (:mod:`pipeline.data.locations`) are read the same way.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from pipeline.data.locations import Location, StorageError, resolve, storage_error
from pipeline.data.normalise import ColumnMapping, check_duplicate_ids, normalise_batch
from pipeline.data.schema import DOCUMENT_SCHEMA
from pipeline.data.sources import (
    PARQUET_SUFFIXES,
    DataSourceError,
    directory_files,
    is_datasets_dir,
    read_table,
)
from pipeline.data.synthetic import sample_qa_documents, sample_summarization_documents
from pipeline.distributed.config import BuiltInSamples, JobConfig
from pipeline.distributed.rundir import JobConfigError
from pipeline.engine.types import Setting, row_question_ids

DRIVER_NORMALISE_MAX_BYTES = 256 * 2**20  # larger Parquet inputs are normalised in Ray
INSTRUCTION_COLUMN = "__instruction__"


def add_instruction_column(table: pa.Table, instruction: str) -> pa.Table:
    """Raw rows plus a constant question column (summaries: the instruction is the question)."""
    if INSTRUCTION_COLUMN in table.column_names:
        table = table.drop_columns([INSTRUCTION_COLUMN])
    return table.append_column(INSTRUCTION_COLUMN, pa.array([instruction] * table.num_rows, pa.string()))


def apply_instruction(table: pa.Table, instruction: str) -> pa.Table:
    """Normalised documents with the instruction as their only question (id ``"0"``)."""
    docs = table.to_pylist()
    for doc in docs:
        refs = doc.get("references") or None
        doc["questions"], doc["question_ids"] = [instruction], ["0"]
        doc["references"] = refs[:1] if refs else None
    return pa.Table.from_pylist(docs, schema=DOCUMENT_SCHEMA)


def instruction_mapping(config: JobConfig):
    return ColumnMapping.of(config.columns, question=INSTRUCTION_COLUMN)


def sample_documents(config: JobConfig) -> pa.Table:
    """The built-in sample documents of the job; their generation limit is the job's
    ``max_new_tokens`` (user inputs may carry a per-row ``max_new_tokens`` column instead)."""
    if not isinstance(config, BuiltInSamples):
        raise JobConfigError("input", f"the {config.job} job has no built-in sample documents; give an input")
    make = sample_qa_documents if config.job == "longdoc_qa" else sample_summarization_documents
    docs = make(config.sample_docs, config.sample_words, config.sample_seed)
    for doc in docs:
        doc["max_new_tokens"] = None
    return pa.Table.from_pylist(docs, schema=DOCUMENT_SCHEMA)


def input_location(config: JobConfig) -> Location:
    try:
        return resolve(config.input)
    except StorageError as exc:
        raise JobConfigError("input", str(exc)) from exc


def _parquet_size(location: Location) -> int | None:
    """Total size of a Parquet input (file, directory or prefix), or None when it is not Parquet
    (JSONL, a ``datasets`` directory, nothing there: a hub dataset name)."""
    try:
        info = location.info()
        if info.type == pafs.FileType.File:
            return info.size if location.suffix in PARQUET_SUFFIXES else None
        if info.type != pafs.FileType.Directory or is_datasets_dir(location):
            return None
        files, unknown = directory_files(location)
    except OSError as exc:
        raise JobConfigError("input", f"cannot access {location}: {storage_error(exc)}") from exc
    if unknown or not files or any(i.extension not in ("parquet", "pq") for i in files):
        return None  # not all Parquet: read on the driver, which also refuses or skips unknown files
    return sum(i.size or 0 for i in files)


def choose_normalise(config: JobConfig) -> str:
    if config.input is None:
        if config.normalise == "ray":
            raise JobConfigError("normalise", "'ray' needs a Parquet file or directory as input")
        return "driver"
    size = _parquet_size(input_location(config))
    if config.normalise != "auto":
        if config.normalise == "ray" and size is None:
            raise JobConfigError("normalise", "'ray' needs a Parquet file or directory as input")
        return config.normalise
    return "ray" if size is not None and size > DRIVER_NORMALISE_MAX_BYTES else "driver"


def load_documents(config: JobConfig) -> pa.Table:
    """Read and normalise the whole input on the driver (``normalise="driver"``)."""
    if config.input is None:
        table = sample_documents(config)
    else:
        mapping = config.columns
        try:
            raw = read_table(
                config.input,
                split=config.split,
                config=config.dataset_config,
                ignore_unknown_files=config.ignore_unknown_files,
            )
        except (FileNotFoundError, DataSourceError) as exc:
            raise JobConfigError("input", str(exc)) from exc
        if raw.num_rows == 0:
            raise JobConfigError("input", f"{config.input} holds no rows: nothing to answer")
        if config.instruction is not None:
            raw, mapping = add_instruction_column(raw, config.instruction), instruction_mapping(config)
        try:
            table = normalise_batch(raw, mapping, row_offset=0)
        except ValueError as exc:
            raise JobConfigError("columns", str(exc)) from exc
    if config.instruction is not None:
        table = apply_instruction(table, config.instruction)
    try:
        check_duplicate_ids(table)
    except ValueError as exc:
        raise JobConfigError("input", str(exc)) from exc
    return table


def check_ray_input(config: JobConfig) -> dict:
    """Schema-only checks for ``normalise="ray"``; returns the resolved column roles."""
    location = input_location(config)
    try:
        dataset = pads.dataset(location.path, filesystem=location.fs, format="parquet", ignore_prefixes=[".", "_"])
        schema, rows = dataset.schema, dataset.count_rows()  # from the files' metadata
    except (OSError, pa.ArrowInvalid) as exc:
        raise JobConfigError("input", f"cannot read the Parquet files of {location}: {exc}") from exc
    if rows == 0:
        raise JobConfigError("input", f"{location} holds no rows: nothing to answer")
    names = list(schema.names) + ([INSTRUCTION_COLUMN] if config.instruction is not None else [])
    mapping = instruction_mapping(config) if config.instruction is not None else config.columns
    try:
        cols = mapping.resolve(names)
    except ValueError as exc:
        raise JobConfigError("columns", str(exc)) from exc
    if not cols["listed"] and cols["id"] is None:
        raise JobConfigError(
            "columns",
            "one-question-per-row input normalised in Ray needs a document id column "
            "(set the id column, or use normalise='driver')",
        )
    return cols


def drop_done(table: pa.Table, done: dict[str, list[str]], sweep: list[dict] | None = None) -> pa.Table:
    """Ray-side resume filter: keep documents that still miss a committed row (``sweep``: the swept
    settings' :class:`~pipeline.engine.types.Setting` fields, whose row keys a document must all have)."""
    if not done:
        return table
    settings = [Setting(**s) for s in sweep or []]
    keep = [
        not (doc_id in done and set(row_question_ids(qids, settings)) <= set(done[doc_id]))
        for doc_id, qids in zip(table.column("doc_id").to_pylist(), table.column("question_ids").to_pylist())
    ]
    return table.filter(pa.array(keep, pa.bool_()))
