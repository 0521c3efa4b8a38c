"""Output rows of a batch: exactly one :data:`pipeline.data.OUTPUT_SCHEMA` row per expected key of
each document (each question id, or with a sweep each question id under every setting), made from
the engine's answers or from one error message for the whole document. Used by the actors
(:class:`pipeline.distributed.predictor.Predictor`) and by the driver for documents no actor
survived (:mod:`pipeline.distributed.isolation`)."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

import pyarrow as pa

from pipeline.data.normalise import question_hashes
from pipeline.data.schema import ANSWER, SETTING, columns_filled_by, rows_to_table
from pipeline.engine.types import Answer, Setting

logger = logging.getLogger(__name__)

#: ``score(task, prediction, references, full_cache_prediction)`` -> score or None
ScoreFunction = Callable[[str | None, str | None, list[str] | None, str | None], float | None]


class RowMaker:
    """``job_fields``: the columns every row of the run shares; ``settings`` / ``sweep``: a sweep's
    settings and their configs (empty: one setting, the job's); ``score``: fills ``score`` for answers
    with references (None: left empty)."""

    def __init__(self, job_fields: dict, settings: list[Setting], sweep: list, score: ScoreFunction | None) -> None:
        self.job_fields, self.settings, self.sweep, self.score = dict(job_fields), settings, sweep, score

    def rows_for(self, doc: dict, answers: dict[str, Answer] | str) -> list[dict]:
        """Exactly one row per row key of ``doc``, in key order."""
        qids = list(dict.fromkeys(str(q) for q in (doc.get("question_ids") or ["0"])))  # a key once, even if repeated
        refs = doc.get("references") or []
        full = self._full_cache_predictions(qids, answers)
        hashes = question_hashes(doc)
        rows = []
        for key, (q, setting) in self._keys(qids).items():
            row = {
                **self.job_fields,
                **(setting.columns() if setting else {}),
                "doc_id": str(doc["doc_id"]),
                "question_id": key,
                "task": doc.get("task"),
                "reference": refs[q] if q < len(refs) else None,
                "input_hash": hashes.get(qids[q]),
            }
            if isinstance(answers, str):
                row["error"] = answers
            elif key in answers:
                row.update(self._answer_columns(answers[key]))
                if self.score is not None and row.get("error") is None:
                    row["score"] = self._score(row["task"], row.get("prediction"), row["reference"], full.get(q))
            else:
                row["error"] = "internal: the engine returned no answer for this question"
            rows.append(row)
        return rows

    def _full_cache_predictions(self, qids: list[str], answers: dict[str, Answer] | str) -> dict[int, str]:
        """Question index -> the full-cache setting's prediction, when a sweep includes one."""
        full = next((s for s, c in zip(self.settings, self.sweep) if not c.compresses), None)
        if full is None or isinstance(answers, str):
            return {}
        found = {i: answers.get(full.question_id(q)) for i, q in enumerate(qids)}
        return {i: a.prediction for i, a in found.items() if a is not None and a.error is None}

    def _keys(self, qids: list[str]) -> dict[str, tuple[int, Setting | None]]:
        """Row key -> (question index, setting or None)."""
        if not self.settings:
            return {q: (i, None) for i, q in enumerate(qids)}
        return {s.question_id(q): (i, s) for s in self.settings for i, q in enumerate(qids)}

    @staticmethod
    def _answer_columns(answer: Answer) -> dict:
        row = answer.as_row()
        return {k: v for k, v in row.items() if k in columns_filled_by(ANSWER) or k in columns_filled_by(SETTING)}

    def _score(self, task, prediction, reference, full_cache_prediction) -> float | None:
        try:
            return self.score(task, prediction, reference, full_cache_prediction)
        except Exception:  # noqa: BLE001 - a score that cannot be computed stays empty
            logger.warning("scoring failed for task %r:\n%s", task, traceback.format_exc())
            return None

    def to_table(self, rows: list[dict]) -> pa.Table:
        try:
            return rows_to_table(rows)
        except ValueError:
            pass
        safe = []
        for row in rows:  # find the row(s) the schema cannot hold and replace them by error rows
            try:
                rows_to_table([row])
                safe.append(row)
            except ValueError as exc:
                identity = {
                    k: row.get(k) for k in (*self.job_fields, "doc_id", "question_id", *columns_filled_by(SETTING))
                }
                safe.append({**identity, "error": f"internal: result does not fit the output schema: {exc}"[:2000]})
        return rows_to_table(safe)


#: the one column of an actor's output block: each row one document's rows as an Arrow IPC stream
PACKED = "document_rows"


def pack(table: pa.Table) -> pa.Table:
    """One document's rows as one row. Ray Data cuts an actor's output into blocks by rows; packed, a
    document reaches the driver whole in one block, as soon as the actor yields it."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return pa.table({PACKED: pa.array([sink.getvalue().to_pybytes()], pa.large_binary())})


def unpack(table: pa.Table) -> pa.Table:
    """The rows of the documents packed in ``table`` (:func:`pack`), in order; other tables as they are."""
    if PACKED not in table.column_names:
        return table
    parts = [pa.ipc.open_stream(pa.py_buffer(data)).read_all() for data in table.column(PACKED).to_pylist()]
    return pa.concat_tables(parts) if parts else rows_to_table([])
