"""Inputs and outputs: sources, column mapping, Arrow schemas, built-in synthetic tasks.

Nothing here imports torch or Ray; every function works on plain Python and pyarrow objects.
"""

from pipeline.data.normalise import ColumnMapping, check_duplicate_ids, content_id, normalise_batch, question_hashes
from pipeline.data.schema import (
    DOCUMENT_COLUMNS,
    DOCUMENT_SCHEMA,
    OUTPUT_COLUMNS,
    OUTPUT_SCHEMA,
    SCHEMA_VERSION,
    check_output_table,
    empty_table,
    rows_to_table,
    schema_version,
)
from pipeline.data.sources import DataSourceError, read_documents, read_jsonl, read_table
from pipeline.data.synthetic import (
    QA_KINDS,
    SUMMARY_INSTRUCTION,
    question_rows,
    sample_qa_documents,
    sample_summarization_documents,
    write_documents,
)

__all__ = [
    "ColumnMapping",
    "DataSourceError",
    "DOCUMENT_COLUMNS",
    "DOCUMENT_SCHEMA",
    "OUTPUT_COLUMNS",
    "OUTPUT_SCHEMA",
    "QA_KINDS",
    "SCHEMA_VERSION",
    "SUMMARY_INSTRUCTION",
    "check_duplicate_ids",
    "check_output_table",
    "content_id",
    "empty_table",
    "normalise_batch",
    "question_hashes",
    "question_rows",
    "read_documents",
    "read_jsonl",
    "read_table",
    "rows_to_table",
    "sample_qa_documents",
    "sample_summarization_documents",
    "schema_version",
    "write_documents",
]
