"""The Ray Data actor: one :class:`Predictor` per actor holds one Engine and answers batches.

``ds.map_batches(Predictor, fn_constructor_kwargs=..., compute=ActorPoolStrategy(...),
batch_format="pyarrow")`` calls ``Predictor(**kwargs)`` once per actor (the model is loaded there,
from configs passed as plain dicts so they pickle without surprises) and then ``predictor(batch)``
for each batch of normalised documents (:data:`pipeline.data.DOCUMENT_SCHEMA`).

Contract of ``__call__`` (relied on by the driver's exactly-once guarantee):

* it returns exactly one :data:`pipeline.data.OUTPUT_SCHEMA` row per (``doc_id``, ``question_id``)
  of its input batch, with every one of a document's rows in the same returned table;
* it never raises for anything a row contains: rows with ``input_error`` become error rows
  directly, an exception while generating is retried document by document and then recorded in
  the ``error`` column of that document's rows, and a row the schema cannot hold is replaced by an
  error row. Only the fault-injection switch (tests) raises on purpose.
"""

from __future__ import annotations

import importlib
import logging
import time
import traceback
from collections.abc import Callable

import pyarrow as pa

from pipeline.config import CompressionConfig, GenerationConfig, ModelConfig
from pipeline.data.schema import OUTPUT_SCHEMA, rows_to_table
from pipeline.job_config import FaultConfig

logger = logging.getLogger(__name__)

EngineFactory = Callable[[ModelConfig, CompressionConfig, GenerationConfig], object]


class InjectedFault(RuntimeError):
    """Raised on purpose by the fault-injection switch (tests only)."""


def resolve_factory(path: str | None) -> EngineFactory:
    """``'module:function'`` → the function; None → ``Engine.from_config``."""
    if path is None:
        from pipeline.engine.engine import Engine

        return Engine.from_config
    module, _, name = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"engine_factory {path!r} cannot be imported: {exc}") from exc
    if not callable(factory):
        raise ValueError(f"engine_factory {path!r} is not callable")
    return factory


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


class Predictor:
    """Ray Data callable class (see the module docstring).

    ``row_fields``: identity columns written on every row (``run_id``, ``job``, ``model``,
    ``method``, ``cache_size``, ``budget``).
    """

    def __init__(
        self,
        model: dict,
        compression: dict,
        generation: dict,
        row_fields: dict,
        engine_factory: str | None = None,
        faults: dict | None = None,
        sweep: list[dict] | None = None,
        oom_retry_cache_size: float | None = None,
    ) -> None:
        self.model_config = ModelConfig.model_validate(model)
        self.compression = CompressionConfig.model_validate(compression)
        self.generation = GenerationConfig.model_validate(generation)
        self.row_fields = dict(row_fields)
        self.faults = FaultConfig.model_validate(faults or {})
        self.batches = 0
        self.sweep = [CompressionConfig.model_validate(c) for c in (sweep or [])]
        self.engine = resolve_factory(engine_factory)(self.model_config, self.compression, self.generation)
        if oom_retry_cache_size is not None:
            self.engine.enable_oom_retry(oom_retry_cache_size)
        if self.faults.engine:  # tests: crash / OOM inside this actor's engine
            from pipeline.engine.faults import FaultInjection

            self.engine.faults = FaultInjection.parse(self.faults.engine)

    # ------------------------------------------------------------------ Ray entry point
    def __call__(self, batch: pa.Table) -> pa.Table:
        self.batches += 1
        limit = self.faults.raise_after_batches
        if limit is not None and self.batches > limit:
            time.sleep(self.faults.raise_delay_s)
            raise InjectedFault(f"fault injection: raise_after_batches={limit} reached")
        try:
            docs = batch.to_pylist() if isinstance(batch, pa.Table) else pa.Table.from_batches([batch]).to_pylist()
        except Exception as exc:  # noqa: BLE001 - cannot even read the batch: nothing to key rows on
            logger.error("unreadable batch: %s", traceback.format_exc())
            raise RuntimeError(f"Predictor could not read its input batch: {_short(exc)}") from exc
        rows: list[dict] = []
        for doc, answers in zip(docs, self._answer(docs)):
            rows.extend(self._rows_for(doc, answers))
        return self._to_table(rows)

    # ------------------------------------------------------------------ generation
    def _answer(self, docs: list[dict]) -> list[dict[str, dict] | str]:
        """Per document: {question_id: answer row} or an error message for the whole document."""
        from pipeline.engine.types import Request

        results: list[dict[str, dict] | str] = [{} for _ in docs]
        pending: list[tuple[int, Request]] = []
        for i, doc in enumerate(docs):
            if doc.get("input_error"):
                results[i] = str(doc["input_error"])
                continue
            try:
                pending.append((i, Request(
                    doc_id=str(doc["doc_id"]), context=doc["context"], questions=list(doc["questions"]),
                    question_ids=[str(q) for q in doc["question_ids"]],
                    answer_prefix=doc.get("answer_prefix") or "", max_new_tokens=doc.get("max_new_tokens"),
                )))
            except Exception as exc:  # noqa: BLE001 - a malformed document becomes its error rows
                results[i] = _short(exc)
        if not pending:
            return results
        try:
            answered = iter(self._generate([request for _, request in pending]))
            grouped = []
            for i, request in pending:  # answers come in request order, one per question
                answers = [next(answered) for _ in request.question_ids]
                if any(a.doc_id != request.doc_id for a in answers):
                    raise RuntimeError("engine answers are out of order")
                grouped.append((i, {a.question_id: self._answer_row(a) for a in answers}))
            for i, answers in grouped:
                results[i] = answers
        except Exception:  # noqa: BLE001 - isolate the document(s) that fail
            logger.warning("batch of %d documents failed, retrying one by one:\n%s", len(pending), traceback.format_exc())
            for i, request in pending:
                try:
                    results[i] = {a.question_id: self._answer_row(a) for a in self._generate([request])}
                except Exception as exc:  # noqa: BLE001
                    results[i] = _short(exc)
        return results

    def _generate(self, requests: list) -> list:
        bad = [r.doc_id for r in requests if r.doc_id in self.faults.error_doc_ids]
        if bad:
            raise InjectedFault(f"fault injection: generation failed for document {bad[0]!r}")
        if self.sweep:
            return self._generate_sweep(requests)
        return self.engine.generate(requests)

    def _generate_sweep(self, requests: list) -> list:
        """Answers for every swept setting from one prefill per document (engine.generate_sweep).

        Requests carry question ids ``<question>|<method>|<cache_size>`` (one entry per setting);
        each distinct question is asked once per setting and its answers are returned under those
        ids, in the requests' order, with the setting's method and cache size on the row.
        """
        from pipeline.engine.types import Request
        from pipeline.eval.sweep import setting_key, split_question_id

        base_requests = []
        for request in requests:
            base = dict.fromkeys(split_question_id(q)[0] for q in request.question_ids)
            first = {split_question_id(q)[0]: text for q, text in zip(request.question_ids, request.questions)}
            base_requests.append(Request(
                doc_id=request.doc_id, context=request.context, questions=[first[b] for b in base],
                question_ids=list(base), answer_prefix=request.answer_prefix, max_new_tokens=request.max_new_tokens,
            ))
        per_setting = self.engine.generate_sweep(base_requests, self.sweep)
        found = {}
        for setting, answers in zip(self.sweep, per_setting):
            key = setting_key(setting)
            for answer in answers:
                answer.question_id = f"{answer.question_id}|{key}"
                answer.extra.update(method=setting.method, cache_size=setting.cache_size, budget=setting.budget)
                found[(answer.doc_id, answer.question_id)] = answer
        return [found[(r.doc_id, q)] for r in requests for q in r.question_ids]

    # ------------------------------------------------------------------ rows
    @staticmethod
    def _answer_row(answer) -> dict:
        """Contract columns of an answer; a sweep's per-setting method / cache size win."""
        row = answer.as_row()
        row.update({k: v for k, v in answer.extra.items() if k in ("method", "cache_size", "budget")})
        return row

    def _rows_for(self, doc: dict, answers: dict[str, dict] | str) -> list[dict]:
        """Exactly one row per question id of ``doc``, in question order."""
        qids = list(dict.fromkeys(str(q) for q in (doc.get("question_ids") or ["0"])))  # a key once, even if repeated
        refs = doc.get("references") or []
        rows = []
        for q, qid in enumerate(qids):
            row = {**self.row_fields, "doc_id": str(doc["doc_id"]), "question_id": qid,
                   "reference": refs[q] if q < len(refs) else None, "score": None}
            if isinstance(answers, str):
                row["error"] = answers
            elif qid in answers:
                skip = ("doc_id", "question_id")
                row.update({k: v for k, v in answers[qid].items() if k in OUTPUT_SCHEMA.names and k not in skip})
                row["task"] = doc.get("task")
                row["score"] = self._score(doc.get("task"), row.get("prediction"), row["reference"])
            else:
                row["error"] = "internal: the engine returned no answer for this question"
            rows.append(row)
        return rows

    @staticmethod
    def _score(task: str | None, prediction: str | None, reference: list[str] | None) -> float | None:
        """Score of an answer when its document names a known task (RULER / LongBench) and has references."""
        if not task or not reference:
            return None
        from pipeline.eval.sweep import metric_for_task, score_prediction

        try:
            return score_prediction(metric_for_task(task), prediction, reference)
        except Exception:  # noqa: BLE001 - a score that cannot be computed stays empty
            return None

    def _to_table(self, rows: list[dict]) -> pa.Table:
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
                safe.append({**self.row_fields, "doc_id": str(row["doc_id"]), "question_id": str(row["question_id"]),
                             "error": f"internal: result does not fit the output schema: {exc}"[:2000]})
        return rows_to_table(safe)
