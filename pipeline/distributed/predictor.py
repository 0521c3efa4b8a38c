"""The Ray Data actor: one :class:`Predictor` per actor holds one Engine and answers batches.

``ds.map_batches(Predictor, fn_constructor_kwargs=..., compute=ActorPoolStrategy(...),
batch_format="pyarrow")`` calls ``Predictor(**kwargs)`` once per actor (the model is loaded there,
from configs passed as plain dicts so they pickle without surprises) and then ``predictor(batch)``
for each batch of normalised documents (:data:`pipeline.data.DOCUMENT_SCHEMA`).

Contract of ``__call__`` (relied on by the driver's exactly-once guarantee):

* it yields, per document of its input batch and as soon as that document is answered, one packed
  table (:func:`pipeline.distributed.rows.pack`) holding exactly one :data:`pipeline.data.OUTPUT_SCHEMA`
  row per expected key of the document (:func:`row_question_ids`: each question id, or with a sweep
  each question id under every setting). The engine hands each document on as its last row leaves
  the continuous decode batch (:mod:`pipeline.engine.emitter`), so the driver commits it while the
  rest of the call decodes: a crash loses the documents not finished, not the whole call.
  the driver unpacks them (:func:`pipeline.distributed.rows.unpack`);
* it never raises for anything a row contains: rows with ``input_error`` become error rows
  directly, an exception while generating is retried document by document and then recorded in
  the ``error`` column of that document's rows, and a row the schema cannot hold is replaced by an
  error row. Only the test hook (:mod:`pipeline.hooks`) raises on purpose.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import os
import queue
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa

from pipeline import hooks
from pipeline.distributed.rows import RowMaker, ScoreFunction, pack
from pipeline.engine.config import GenerationConfig, ModelConfig
from pipeline.engine.loading import default_cache_dir
from pipeline.engine.types import Answer, Request, Setting, row_question_ids
from pipeline.kv.config import CompressionConfig

logger = logging.getLogger(__name__)

EngineFactory = Callable[[ModelConfig, CompressionConfig, GenerationConfig], object]
#: (task, prediction, references, full-cache prediction of the same question in a sweep) -> score or None


def resolve_factory(path: str | None) -> EngineFactory:
    """``'module:function'`` → the function; None → ``Engine.from_config``."""
    if path is None:
        from pipeline.engine.engine import Engine  # the actor's heavy import (torch, transformers) happens here

        return Engine.from_config
    module, _, name = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"engine_factory {path!r} cannot be imported: {exc}") from exc
    if not callable(factory):
        raise ValueError(f"engine_factory {path!r} is not callable")
    return factory


def source_fingerprint(root: Path) -> str:
    """Hash of every ``.py`` file under ``root`` (relative path and bytes)."""
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def package_fingerprint() -> str:
    """:func:`source_fingerprint` of the imported ``pipeline`` package.

    The driver passes its own to every actor, which compares it with the package it imported: Ray
    puts the driver's working directory and script directory first on its workers' import path, so
    a directory holding another copy of ``pipeline/`` (an older checkout, a worktree, a user's own
    package of that name) would silently run other code in the actors.
    """
    return source_fingerprint(Path(__file__).resolve().parents[1])


def check_same_code(driver_fingerprint: str | None) -> None:
    """Raise when this process imported other ``pipeline`` code than the driver did (see above)."""
    if driver_fingerprint is None or driver_fingerprint == package_fingerprint():
        return
    here = Path(__file__).resolve().parents[1]
    raise RuntimeError(
        f"this Ray worker imported the pipeline package from {here}, whose code differs from the driver's: "
        f"Ray puts the driver's working directory ({os.getcwd()}) first on its workers' import path, so another "
        "copy of pipeline/ there shadows the driver's; start the job from a directory without one"
    )


def setting_of(config: CompressionConfig) -> Setting:
    return Setting(config.label, config.cache_size, config.budget)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def _request(doc: dict) -> Request:
    return Request(
        doc_id=str(doc["doc_id"]),
        context=doc["context"],
        questions=list(doc["questions"]),
        question_ids=[str(q) for q in doc["question_ids"]],
        answer_prefix=doc.get("answer_prefix") or "",
        max_new_tokens=doc.get("max_new_tokens"),
    )


def local_kvzap_files(files: dict[str, bytes]) -> dict[str, str]:
    """{driver path: path on this node} for KVzap files sent as bytes: the driver's path where it holds
    the same bytes here, else a copy in this node's cache (named by content, written atomically)."""
    out = {}
    for path, data in files.items():
        digest = hashlib.sha256(data).hexdigest()[:16]
        if Path(path).is_file() and hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] == digest:
            out[path] = path
            continue
        copy = default_cache_dir() / "kvzap" / "received" / f"{digest}.safetensors"
        if not copy.is_file():
            copy.parent.mkdir(parents=True, exist_ok=True)
            tmp = copy.with_name(f".tmp-{os.getpid()}-{copy.name}")
            tmp.write_bytes(data)
            os.replace(tmp, copy)
        out[path] = str(copy)
    return out


class Predictor:
    """Ray Data callable class (see the module docstring).

    ``job_fields``: the columns that are the same on every row of the run (``run_id``, ``job``,
    ``model``) plus the job's setting (``method``, ``cache_size``, ``budget``); ``score``: fills the
    ``score`` column of answers whose document has references (None: left empty);
    ``code_fingerprint``: the driver's :func:`package_fingerprint` (None: not checked).
    """

    def __init__(
        self,
        model: dict,
        compression: dict,
        generation: dict,
        job_fields: dict,
        engine_factory: str | None = None,
        sweep: list[dict] | None = None,
        oom_retry_cache_size: float | None = None,
        score: ScoreFunction | None = None,
        code_fingerprint: str | None = None,
        kvzap_files: dict[str, bytes] | None = None,
    ) -> None:
        check_same_code(code_fingerprint)  # before the model load: a mismatch fails within seconds
        self.model_config = ModelConfig.model_validate(model)
        local = local_kvzap_files(kvzap_files or {})
        compression = {
            **compression,
            "kvzap_model": local.get(compression.get("kvzap_model"), compression.get("kvzap_model")),
        }
        sweep = [{**c, "kvzap_model": local.get(c.get("kvzap_model"), c.get("kvzap_model"))} for c in sweep or []]
        self.compression = CompressionConfig.model_validate(compression)
        self.generation = GenerationConfig.model_validate(generation)
        self.batches = 0
        self.sweep = [CompressionConfig.model_validate(c) for c in sweep]
        self.settings = [setting_of(c) for c in self.sweep]
        self.rows = RowMaker(job_fields, self.settings, self.sweep, score)
        self.engine = resolve_factory(engine_factory)(self.model_config, self.compression, self.generation)
        if oom_retry_cache_size is not None:
            self.engine.enable_oom_retry(oom_retry_cache_size)

    # ------------------------------------------------------------------ Ray entry point
    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        """One packed table per document of ``batch``, each as soon as it is answered (module docstring)."""
        self.batches += 1
        try:
            docs = batch.to_pylist() if isinstance(batch, pa.Table) else pa.Table.from_batches([batch]).to_pylist()
        except Exception as exc:  # noqa: BLE001 - cannot even read the batch: nothing to key rows on
            logger.error("unreadable batch: %s", traceback.format_exc())
            raise RuntimeError(f"Predictor could not read its input batch: {_short(exc)}") from exc
        hooks.fire("predictor.batch", batch=self.batches, doc_ids=[str(d.get("doc_id")) for d in docs])
        for i, answers in self._answers(docs):
            yield pack(self.rows.to_table(self.rows.rows_for(docs[i], answers)))

    # ------------------------------------------------------------------ generation
    def _answers(self, docs: list[dict]) -> Iterator[tuple[int, dict[str, Answer] | str]]:
        """(document index, {row question id: answer} or an error message for the whole document),
        each document as soon as it is known."""
        pending: list[tuple[int, Request]] = []
        for i, doc in enumerate(docs):
            if doc.get("input_error"):
                yield i, str(doc["input_error"])
                continue
            try:
                pending.append((i, _request(doc)))
            except Exception as exc:  # noqa: BLE001 - a malformed document becomes its error rows
                yield i, _short(exc)
        if not pending:
            return
        answered: set[int] = set()
        try:
            for i, keyed in self._stream(pending):
                answered.add(i)
                yield i, keyed
        except Exception:  # noqa: BLE001 - isolate the document(s) that fail
            logger.warning(
                "batch of %d documents failed, retrying one by one:\n%s", len(pending), traceback.format_exc()
            )
            for i, request in pending:
                if i in answered:
                    continue
                try:
                    yield self._keyed([(i, request)], self._generate([request]))[0]
                except Exception as exc:  # noqa: BLE001
                    yield i, _short(exc)

    def _stream(self, pending: list[tuple[int, Request]]) -> Iterator[tuple[int, dict[str, Answer]]]:
        """(document index, {row question id: answer}) as the engine finishes each document: the engine
        runs in a thread and hands documents on through a queue. A sweep, or an engine whose
        ``generate`` takes no ``on_document`` (a custom ``--engine-factory``), answers them all at the
        end of the call."""
        requests = [request for _, request in pending]
        if self.sweep or "on_document" not in inspect.signature(self.engine.generate).parameters:
            yield from self._keyed(pending, self._generate(requests))
            return
        handed: queue.Queue = queue.Queue()
        failure: list[BaseException] = []

        def work() -> None:
            try:
                self._generate(requests, on_document=lambda k, answers: handed.put((k, answers)))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
                failure.append(exc)
            finally:
                handed.put(None)

        worker = threading.Thread(target=work, name="predictor-generate", daemon=True)
        worker.start()
        while (item := handed.get()) is not None:
            k, answers = item
            yield self._keyed([pending[k]], answers)[0]
        worker.join()
        if failure:
            raise failure[0]

    def _keyed(self, pending: list[tuple[int, Request]], answers: list[Answer]) -> list[tuple[int, dict]]:
        """Answers come in request order, one per row key of each request."""
        it = iter(answers)
        grouped = []
        for i, request in pending:
            keyed = {}
            for key in row_question_ids(request.question_ids, self.settings):
                answer = next(it)
                if answer.doc_id != request.doc_id:
                    raise RuntimeError("engine answers are out of order")
                keyed[key] = answer
            grouped.append((i, keyed))
        return grouped

    def _generate(self, requests: list[Request], on_document=None) -> list[Answer]:
        """The engine's answers to ``requests``; ``on_document`` (no sweep): see ``Engine.generate``."""
        hooks.fire("predictor.generate", doc_ids=[r.doc_id for r in requests])
        if on_document is not None:
            return self.engine.generate(requests, on_document=on_document)
        if not self.sweep:
            return self.engine.generate(requests)
        per_setting = self.engine.generate_sweep(requests, self.sweep)
        by_request = [[] for _ in requests]
        for answers in per_setting:  # setting-major -> per request, setting-major inside
            it = iter(answers)
            for r, request in enumerate(requests):
                by_request[r] += [next(it) for _ in request.question_ids]
        return [a for answers in by_request for a in answers]
