"""Column mapping and normalisation of raw input tables to :data:`DOCUMENT_SCHEMA`.

:func:`normalise_batch` is a plain, picklable function of one Arrow batch, so the Ray driver can
run it inside ``map_batches(normalise_batch, fn_kwargs={"mapping": m}, batch_format="pyarrow")``.

Rules (also in the README):

* Two input shapes: one question per row (``question`` column; rows with the same doc id and the
  same context become one document, questions in row order) or a list column of questions per
  document (``questions``). Grouping happens within the batch it is given, so the driver must keep
  a document's rows in one batch (``read_documents`` normalises the whole input at once).
* Optional columns left unset in the mapping are picked up under their conventional names when
  present: ``question_id``/``question_ids``, ``reference``/``references``, ``answer_prefix``,
  ``max_new_tokens``; a normalised table therefore normalises to itself.
* A missing id column gives each document a stable content id (:func:`content_id` of its context).
* Bad values never raise: the row is kept with ``context`` null (when the context is unusable) and
  ``input_error`` saying what is wrong. An ``input_error`` already in the input (a reader's error,
  e.g. an invalid JSONL line) is kept as is. Every document keeps at least one question id, so the
  driver can emit one error row per question id and no input row vanishes from the output.
* Missing required columns (context, questions, or a column named explicitly in the mapping) are a
  configuration error: ``ValueError`` listing the available columns.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.data.schema import DOCUMENT_SCHEMA


def _column(default: str | None, description: str, flag: str):
    return Field(default, description=description, json_schema_extra={"flag": f"{flag}_column"})


class DocumentColumns(BaseModel):
    """Input columns (which columns hold the document id, context and optional extras).

    The columns of a job whose documents all get one instruction (summaries): no question columns.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = _column("doc_id", "document id (missing: a content hash of the context)", "id")
    context: str = _column("context", "the long document", "context")
    answer_prefix: str | None = _column(
        None, "text the answer starts with (default: an answer_prefix column)", "answer_prefix"
    )
    reference: str | None = _column(
        None, "reference answer(s) for scoring (default: a reference(s) column)", "reference"
    )
    max_new_tokens: str | None = _column(
        None, "per-row generation limit (default: a max_new_tokens column)", "max_new_tokens"
    )
    task: str | None = _column(
        None, "evaluation task name, copied to the output's task column (default: a task column)", "task"
    )

    @field_validator("*")
    @classmethod
    def _non_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("column names must not be empty")
        return value


class ColumnMapping(DocumentColumns):
    """Input columns (which columns hold the document id, context, question(s) and optional extras).

    Set ``question`` for one question per row, or ``questions`` for a list column per document
    (setting ``questions`` overrides the ``question`` default).
    """

    question: str | None = _column("question", "one question per row", "question")
    questions: str | None = _column(None, "a list of questions per row (instead of --question-column)", "questions")
    question_id: str | None = _column(
        None, "question ids (default: a question_id(s) column, else 0, 1, ...)", "question_id"
    )

    @classmethod
    def of(cls, columns: DocumentColumns, **questions: str) -> ColumnMapping:
        """The mapping of ``columns`` (the flags that were given) with these question columns."""
        return cls(**columns.model_dump(exclude_unset=True, include=set(DocumentColumns.model_fields)), **questions)

    @model_validator(mode="after")
    def _one_question_shape(self) -> ColumnMapping:
        if self.questions is not None and "question" in self.model_fields_set and self.question:
            raise ValueError("set either question (one per row) or questions (a list per row), not both")
        return self

    def resolve(self, available: list[str], allow_missing: bool = False) -> dict[str, Any]:
        """Map roles to present columns; ``ValueError`` (listing ``available``) when one is missing."""
        explicit, cols, missing = self.model_fields_set, set(available), []

        def pick(role: str, *conventional: str) -> str | None:
            name = getattr(self, role)
            if name is not None and (role in explicit or role == "context"):
                if name not in cols:
                    missing.append(f"{role}={name!r}")
                return name
            return next((c for c in (name, *conventional) if c is not None and c in cols), None)

        listed = self.questions is not None or (
            "question" not in explicit and (self.question or "question") not in cols and "questions" in cols
        )
        out = {"listed": listed, "id": pick("id"), "context": pick("context")}
        if listed:
            out["question"] = self.questions or "questions"
            if out["question"] not in cols:
                missing.append(f"questions={out['question']!r}")
        else:
            out["question"] = self.question or "question"
            if out["question"] not in cols:
                missing.append(f"question={out['question']!r} (or a 'questions' list column)")
        plural = "s" if listed else ""
        out["question_id"] = pick("question_id", "question_id" + plural)
        out["reference"] = pick("reference", "references" if listed else "reference")
        out["answer_prefix"] = pick("answer_prefix", "answer_prefix")
        out["max_new_tokens"] = pick("max_new_tokens", "max_new_tokens")
        out["task"] = pick("task", "task")
        if missing and not allow_missing:
            raise ValueError(
                f"column mapping: missing column(s) {', '.join(missing)}; available columns: "
                f"{', '.join(available) if available else '(none)'}"
            )
        return out


def content_id(text: str) -> str:
    """Stable document id from content: the first 16 hex digits of the SHA-1 of its UTF-8 text."""
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def question_hashes(doc: Mapping[str, Any]) -> dict[str, str]:
    """Question id -> a digest of what its answer is computed from (the context, the question, the
    answer prefix and the generation limit) for one normalised document (:data:`DOCUMENT_SCHEMA`
    fields); the output's ``input_hash``. A repeated question id keeps its first question."""
    shared = content_id(
        "\x1f".join([doc.get("context") or "", doc.get("answer_prefix") or "", str(doc.get("max_new_tokens"))])
    )
    out: dict[str, str] = {}
    for qid, question in zip(doc.get("question_ids") or [], doc.get("questions") or []):
        out.setdefault(str(qid), content_id(f"{shared}\x1f{question or ''}"))  # the context hashed once
    return out


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _text(value: object, what: str, errors: list[str]) -> str | None:
    """A usable non-blank string, or None with the reason appended to ``errors``."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            errors.append(f"{what} is bytes that are not valid UTF-8 ({exc.reason} at byte {exc.start})")
            return None
    if value is None:
        errors.append(f"{what} is null or missing")
    elif not isinstance(value, str):
        errors.append(f"{what} is {_a(_kind(value))}, expected a string")
    elif not value.strip():
        errors.append(f"{what} is {'empty' if not value else 'only whitespace'}")
    else:
        return value
    return None


def _refs(value: object, what: str, errors: list[str]) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) or v is None for v in value):
        return [v for v in value if v is not None]
    errors.append(f"{what} is {_a(_kind(value))}, expected a string or a list of strings")
    return None


def _max_tokens(value: object, errors: list[str]) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    errors.append(f"max_new_tokens must be a positive integer, got {value!r}")
    return None


def _parse_row(row: dict, cols: dict[str, Any], where: str) -> dict:
    """One input row → a partial document (questions as lists) plus its problems."""
    errors: list[str] = []
    get = lambda role: row.get(cols[role]) if cols[role] else None  # noqa: E731
    context = _text(get("context"), f"{where}context", errors)
    raw_q, raw_ids, raw_refs = get("question"), get("question_id"), get("reference")
    if not cols["listed"]:
        questions = [_text(raw_q, f"{where}question", errors)]
        ids = [None if raw_ids is None else str(raw_ids)]
        refs = [_refs(raw_refs, f"{where}reference", errors)]
    elif not isinstance(raw_q, (list, tuple)) or not raw_q:
        errors.append(
            f"{where}questions is {'an empty list' if isinstance(raw_q, (list, tuple)) else _a(_kind(raw_q))}, "
            "expected a non-empty list of strings"
        )
        questions, ids, refs = [None], [None], [None]
    else:
        questions = [_text(q, f"{where}question {i}", errors) for i, q in enumerate(raw_q)]
        ids = [None] * len(questions)
        if raw_ids is not None:
            if isinstance(raw_ids, (list, tuple)) and len(raw_ids) == len(questions):
                ids = [None if q is None else str(q) for q in raw_ids]
            else:
                errors.append(f"{where}question_ids must be a list of {len(questions)} ids, got {raw_ids!r}"[:300])
        refs = [None] * len(questions)
        flat = isinstance(raw_refs, str) or (
            isinstance(raw_refs, (list, tuple)) and all(isinstance(r, str) for r in raw_refs)
        )
        if raw_refs is None:
            pass
        elif len(questions) == 1 and flat:  # all references of the only question
            refs = [_refs(raw_refs, f"{where}references", errors)]
        elif isinstance(raw_refs, (list, tuple)) and len(raw_refs) == len(questions):
            refs = [_refs(r, f"{where}references[{i}]", errors) for i, r in enumerate(raw_refs)]
        else:
            errors.append(
                f"{where}references must hold one entry per question ({len(questions)}), "
                f"got {_a(_kind(raw_refs))}" + (f" of {len(raw_refs)}" if isinstance(raw_refs, list) else "")
            )
    prefix = get("answer_prefix")
    if prefix is not None and not isinstance(prefix, str):
        errors.append(f"{where}answer_prefix is {_a(_kind(prefix))}, expected a string")
        prefix = None
    doc_id = get("id")
    doc_id = None if doc_id is None or (isinstance(doc_id, str) and not doc_id.strip()) else str(doc_id)
    return {
        "doc_id": doc_id,
        "context": context,
        "questions": questions,
        "question_ids": ids,
        "references": refs,
        "answer_prefix": prefix or "",
        "max_new_tokens": _max_tokens(get("max_new_tokens"), errors),
        "task": get("task") if isinstance(get("task"), str) else None,
        "errors": errors,
        "reader_error": row.get("input_error"),
        "raw": row,
    }


def _fallback_id(part: dict) -> str:
    if part["context"] is not None:
        return content_id(part["context"])
    # unusable context: hash the whole row (a reader error names its line, so ids stay distinct)
    return content_id("row:" + json.dumps(part["raw"], sort_keys=True, default=repr))


def _merge(doc: dict, part: dict) -> None:
    doc["questions"] += part["questions"]
    doc["question_ids"] += part["question_ids"]
    doc["references"] += part["references"]
    doc["errors"] += part["errors"]
    if part["answer_prefix"] != doc["answer_prefix"]:
        doc["errors"].append(
            f"rows of this document disagree on answer_prefix: {doc['answer_prefix']!r} vs {part['answer_prefix']!r}"
        )
    if part["max_new_tokens"] is not None:  # rows that differ: the largest request wins
        doc["max_new_tokens"] = max(doc["max_new_tokens"] or 0, part["max_new_tokens"])
    if part["reader_error"] and not doc["reader_error"]:
        doc["reader_error"] = part["reader_error"]


def _finish(doc: dict) -> dict:
    ids = [qid if qid is not None else str(i) for i, qid in enumerate(doc["question_ids"])]
    dup = sorted(qid for qid, n in Counter(ids).items() if n > 1)
    if dup:
        doc["errors"].append(f"duplicate question_id(s) {', '.join(map(repr, dup))}")
    error = doc["reader_error"] or ("; ".join(doc["errors"]) or None)
    references = doc["references"] if any(r is not None for r in doc["references"]) else None
    return {
        "doc_id": doc["doc_id"],
        "context": doc["context"],
        "questions": doc["questions"],
        "question_ids": ids,
        "answer_prefix": doc["answer_prefix"],
        "references": references,
        "max_new_tokens": doc["max_new_tokens"],
        "input_error": error,
        "task": doc.get("task"),
    }


def normalise_batch(
    table: pa.Table | pa.RecordBatch, mapping: ColumnMapping | None = None, row_offset: int | None = None
) -> pa.Table:
    """Normalise one raw Arrow batch to :data:`DOCUMENT_SCHEMA` (see the module docstring).

    ``row_offset``: when given, problems name the input row (``row_offset`` + index in the batch);
    leave it None in Ray, where a batch's position in the input is unknown. Rows read from JSONL
    (an ``input_line`` column) are named by their line number instead.
    """
    mapping = mapping or ColumnMapping()
    if not isinstance(table, (pa.Table, pa.RecordBatch)):
        if hasattr(table, "to_dict") and hasattr(table, "columns"):  # a pandas DataFrame
            table = pa.Table.from_pandas(table, preserve_index=False)
        else:
            raise TypeError(f"normalise_batch expects a pyarrow Table or RecordBatch, got {type(table).__name__}")
    names = list(table.schema.names)
    errored = table.column("input_error").to_pylist() if "input_error" in names else None
    # Rows a reader could not parse carry no columns; only tables with readable rows must map fully.
    only_errors = errored is not None and all(e is not None for e in errored)
    cols = mapping.resolve(names, allow_missing=only_errors)
    extra = {"input_error", "input_line"} & set(names)
    wanted = {c for key, c in cols.items() if key != "listed" and c in names} | extra
    rows = table.select(sorted(wanted)).to_pylist() if wanted else [{} for _ in range(table.num_rows)]
    docs: dict[tuple, dict] = {}
    for index, row in enumerate(rows):
        qid = row.get(cols["question_id"]) if cols["question_id"] and not cols["listed"] else None
        if row.get("input_line") is not None:
            where = f"line {row['input_line']}: "
        elif row_offset is not None:
            where = f"row {row_offset + index}: "
        else:
            where = f"question_id {str(qid)!r}: " if qid is not None else ""
        part = _parse_row(row, cols, where)
        part["doc_id"] = part["doc_id"] or _fallback_id(part)
        key = (part["doc_id"], part["context"] if part["context"] is not None else repr(row.get(cols["context"])))
        if cols["listed"]:
            docs[(index,)] = part
        elif key in docs:
            _merge(docs[key], part)
        else:
            docs[key] = part
    out = [_finish(doc) for doc in docs.values()]
    return pa.Table.from_pylist(out, schema=DOCUMENT_SCHEMA)


def check_duplicate_ids(table: pa.Table) -> None:
    """Raise ``ValueError`` listing every ``doc_id`` that occurs on more than one row.

    After normalisation the same id on two rows means two different contexts share one id; the
    output is checkpointed and joined on ``doc_id``, so such input must be fixed first.
    """
    if "doc_id" not in table.column_names:
        raise ValueError(f"no doc_id column; available columns: {', '.join(table.column_names)}")
    counts = Counter(table.column("doc_id").to_pylist())
    dup = sorted((str(k), n) for k, n in counts.items() if n > 1)
    if dup:
        shown = ", ".join(f"{k!r} ({n} rows)" for k, n in dup[:50])
        raise ValueError(
            f"{len(dup)} duplicate doc_id(s) with different contexts: {shown}{' ...' if len(dup) > 50 else ''}"
        )
