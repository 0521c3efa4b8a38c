"""The batch-job driver: input → normalised documents → Ray actor pool → committed Parquet.

``run_job(JobConfig)`` does, in this order (everything that can be wrong with the configuration
fails before Ray starts, with :class:`JobConfigError` naming the field):

Input and output may be local paths or ``s3://`` / ``gs://`` URIs (:mod:`pipeline.data.locations`).

1. **Output check**: ``output`` must be a new directory, an empty one, or one written by an
   earlier run of the *same* configuration (its ``manifest.json`` records the settings that define
   a result -- model, method, budgets, decoding, prompts; see ``JobConfig.identity``).
2. **Input** (:mod:`pipeline.distributed.inputs`): documents are normalised to
   ``DOCUMENT_SCHEMA`` (one row per document, its questions in lists), so that all question rows
   of a document travel in one batch and share one compressed context. ``normalise="driver"``
   (the default for built-in samples, JSONL, ``datasets`` directories, hub datasets and Parquet
   up to 256 MiB) reads and normalises on the driver with
   :func:`pipeline.data.read_table` / :func:`pipeline.data.normalise_batch` (JSONL lines that cannot
   be parsed become error rows, duplicate ``doc_id`` values are rejected up front) and hands Ray
   one block per actor batch. ``normalise="ray"`` (default for larger Parquet inputs) reads with
   ``ray.data.read_parquet`` and normalises in Ray tasks: ``map_batches(normalise_batch)`` for
   one-row-per-document inputs, ``groupby(id).map_groups(normalise_batch)`` for
   one-question-per-row inputs (which then need an id column); the driver only reads the schema.
3. **Resume**: while holding ``OUT/.lock`` (local outputs; object stores have no lock, see
   :mod:`pipeline.distributed.rundir`), the driver deletes temporary files of killed writes and
   reads the (doc_id, question_id) keys of the committed files in ``OUT/data``. A document is done
   when every one of its question ids has a committed row (with ``retry_errors``: a row without
   ``error``); done documents are not scheduled again.
4. **Ray**: ``map_batches(Predictor, compute=ActorPoolStrategy(min_actors, max_actors),
   num_gpus=gpus_per_actor, num_cpus=cpus_per_actor, batch_size=config.batch_size_for(documents),
   batch_format="pyarrow")``; an actor yields each document's rows as it is answered (one packed row,
   its own block), the driver iterates the blocks (``iter_batches(batch_size=None, prefetch_batches=0)``)
   and commits each document as one Parquet file (:class:`~pipeline.distributed.sink.BatchCommitter`, atomic)
   as it arrives, while its call still decodes; a driver killed at any moment leaves only whole files;
   with ``echo`` a line per committed file says how many documents are done. Committing on the driver
   puts the files where the next run looks and needs no write-task workers (see the committer).
   Ray starts locally when none is running (``ray.init(address="local")``), or connects to
   ``ray_address`` / ``$RAY_ADDRESS`` (a head started with ``ray start --head``, a cluster, or the
   cluster a ``ray job submit`` runs on).
5. **Check and summary**: duplicate keys are removed (:func:`sink.dedupe`), every expected
   (doc_id, question_id) is checked to be present, the summary table is printed and
   ``OUT/manifest.json`` records the run (config, versions, host, GPUs, row counts, times).

Why not Ray Data's own ``CheckpointConfig`` (2.60): it filters rows at the *read* operator by an id
column, so ids must exist before normalisation (documents without ids get content-hash ids here),
it keeps its own checkpoint files next to the data and deletes them on success by default, and it
adds an actor pool of its own. The commit-by-rename above gives the same guarantee with files a
user can inspect, and works the same for in-memory (driver-normalised) inputs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import ray
from ray.data import DataContext

from pipeline.data.schema import SCHEMA_VERSION
from pipeline.distributed import sink
from pipeline.distributed.cluster import (
    SESSIONS_DIR,
    LocalRayRecord,
    check_model,
    check_resources,
    cluster_gpus,
    ensure_ray,
    ray_facts,
    stop_dead_sessions,
)
from pipeline.distributed.config import JobConfig
from pipeline.distributed.dataset import build_dataset, job_fields
from pipeline.distributed.failures import describe, storage_hint
from pipeline.distributed.inputs import check_ray_input, choose_normalise, load_documents
from pipeline.distributed.isolation import Isolation, is_worker_death
from pipeline.distributed.manifest import RowCounts, RunRecord, close_abandoned_runs, new_manifest
from pipeline.distributed.predictor import ScoreFunction, setting_of
from pipeline.distributed.rows import RowMaker
from pipeline.distributed.rundir import DATA_DIR, JobConfigError, OutputDir, host_facts, new_run_id, now_iso, versions
from pipeline.distributed.summary import RunSummary, format_summary, summarize
from pipeline.engine.loading import default_cache_dir
from pipeline.engine.types import row_question_ids

__all__ = ["JobConfigError", "JobFailed", "RunResult", "run_job"]


class JobFailed(RuntimeError):
    """The Ray pipeline failed part-way; committed rows stay and a rerun resumes after them."""


@dataclass
class RunResult:
    run_id: str
    output_dir: Path | str  # Path for a local output, the URI string on object storage
    data_dir: Path | str
    manifest_path: Path | str
    docs_input: int | None  # None when normalised in Ray (count not known up front)
    docs_skipped: int
    docs_scheduled: int | None
    rows_written: int  # committed by this run (after dedupe)
    duplicates_removed: int
    missing_rows: int | None  # expected (doc_id, question_id) keys without a row; None: not checked
    summary: RunSummary
    total_rows: int  # committed rows in the output (all runs)
    wall_s: float
    rows_with_error: int = 0  # committed rows in the output whose error is set (all runs)
    docs_changed: int | None = None  # documents whose committed rows came from other content (None: not checked)
    extra: dict = field(default_factory=dict)


def run_job(
    config: JobConfig, *, echo: bool = True, score: ScoreFunction | None = None, calibration: dict | None = None
) -> RunResult:
    """Run (or resume) a batch job; see the module docstring. Prints the summary when ``echo``;
    ``score(task, prediction, references)`` fills the ``score`` column of answers with references;
    ``calibration``: what the manifest records of a KVzap file calibrated for this job."""
    t0 = time.perf_counter()
    out = OutputDir(config.output)
    out.check(config)
    mode = choose_normalise(config)
    docs = load_documents(config) if mode == "driver" else None
    if mode == "ray":
        check_ray_input(config)
    model_source = check_model(config)
    if not ray.is_initialized():
        stop_dead_sessions(default_cache_dir() / SESSIONS_DIR)
    out.lock()
    try:
        return _Run(
            config, out, mode, t0, score, echo, {"model_source": model_source, "calibration": calibration}
        ).execute(docs)
    finally:
        out.unlock()


def _progress_printer(docs_scheduled: int | None) -> Callable[[pa.Table, int], None]:
    """A line on stderr per committed file: documents done (of those scheduled), rows, elapsed time."""
    start, seen = time.perf_counter(), set()

    def report(table: pa.Table, rows: int) -> None:
        seen.update(table.column("doc_id").to_pylist())
        of = f"/{docs_scheduled}" if docs_scheduled is not None else ""
        elapsed = time.perf_counter() - start
        print(f"committed {len(seen)}{of} documents, {rows} rows, after {elapsed:.0f} s", file=sys.stderr, flush=True)

    return report


class _Run:
    """One run into a locked output directory: schedule what is not committed, run Ray, check, record."""

    def __init__(
        self,
        config: JobConfig,
        out: OutputDir,
        mode: str,
        t0: float,
        score: ScoreFunction | None,
        echo: bool,
        facts: dict,
    ) -> None:
        self.config, self.out, self.mode, self.t0, self.score, self.echo = config, out, mode, t0, score, echo
        self.model_source = facts["model_source"]  # where the weights come from; a Hub revision resolved to its commit
        self.calibration = facts["calibration"]
        self.run_id = new_run_id()
        self.settings = [setting_of(c) for c in config.sweep]
        self.ray_info: dict = {}
        self.manifest_error: str | None = None

    def execute(self, docs: pa.Table | None) -> RunResult:
        manifest = self._open_manifest()
        committed = sink.committed_state(self.out.data_location)
        expected, docs, counts = self._schedule(docs, committed)
        run = self._start_record(manifest, committed, counts)
        error = self._run_ray(docs, committed, manifest, run)
        return self._finish(manifest, run, committed, expected, error)

    def _open_manifest(self) -> dict:
        manifest = self.out.check(self.config)  # again, now that no other run can change the directory
        self.out.data_location.makedirs()
        self.debris = sink.remove_debris(self.out.data_location)
        if manifest is None:
            config = self.config
            manifest = new_manifest(
                SCHEMA_VERSION,
                config.job,
                self.out.location.uri,
                DATA_DIR,
                config.identity(),
                config.fingerprint(),
                now_iso(),
            )
        close_abandoned_runs(manifest, now_iso())
        return manifest

    def _schedule(self, docs: pa.Table | None, committed: sink.Committed):
        """Expected row keys and the documents still to do (driver-normalised inputs only)."""
        if docs is None:
            return None, None, {"docs_input": None, "docs_skipped": None, "docs_scheduled": None, "docs_changed": None}
        changed = sink.changed_inputs(docs, committed)
        if changed and self.echo:
            print(
                f"WARNING: {len(changed)} documents differ from what their committed rows in {self.out.location.uri} "
                f"were computed from ({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}): their old "
                "answers are kept; use a new --output to answer the new content",
                file=sys.stderr,
                flush=True,
            )
        doc_ids = docs.column("doc_id").to_pylist()
        keys = [row_question_ids(qs, self.settings) for qs in docs.column("question_ids").to_pylist()]
        expected = {(d, k) for d, ks in zip(doc_ids, keys) for k in ks}
        docs = sink.uncommitted(docs, committed, self.settings, self.config.retry_errors)
        counts = {
            "docs_input": len(doc_ids),
            "docs_skipped": len(doc_ids) - docs.num_rows,
            "docs_scheduled": docs.num_rows,
            "docs_changed": len(changed),  # committed rows computed from other content (kept, warned)
        }
        return expected, docs, counts

    def _start_record(self, manifest: dict, committed: sink.Committed, counts: dict) -> RunRecord:
        run = RunRecord(
            run_id=self.run_id,
            started_at=now_iso(),
            config=self.config.model_dump(mode="json"),
            normalise=self.mode,
            host=host_facts(),
            versions=versions(),
            temporary_files_removed=self.debris,
            rows=RowCounts(committed_before=committed.rows, **counts),
            model_source=self.model_source,
            calibration=self.calibration,
        )
        manifest["runs"].append(run)
        self._write(manifest)
        return run

    def _write(self, manifest: dict) -> None:
        """Replace the manifest (this run's record as it stands); a storage error is remembered (and
        said at the end), not raised."""
        manifest["updated_at"] = now_iso()
        runs = [r.as_json() if isinstance(r, RunRecord) else r for r in manifest["runs"]]
        try:
            self.out.write_manifest({**manifest, "runs": runs})
            self.manifest_error = None
        except OSError as exc:
            self.manifest_error = describe(exc)

    def _run_ray(self, docs, committed: sink.Committed, manifest: dict, run: RunRecord) -> BaseException | None:
        """Run the Ray pipeline; returns the error of a failed run (re-raises config errors and interrupts)."""
        if docs is not None and docs.num_rows == 0:
            return None
        state = committed.succeeded if self.config.retry_errors else committed.answered
        started_here, record = False, LocalRayRecord(default_cache_dir() / SESSIONS_DIR)
        try:
            started_here, address = ensure_ray(self.config.ray_address)
            if started_here:
                record.write()
            cpus = check_resources(self.config, started_here)
            # a failed actor batch raises its own exception (not "UDF failed"), so the sentence names it
            context = DataContext.get_current()
            context.raise_original_map_exception = True
            # Ray Data fails an execution after 30 min without a finished block: too short for one
            # long document with a large sweep on a CPU; -1 disables its guard
            context.execution_no_progress_timeout_s = self.config.stall_timeout_s or -1
            run.gpu["cluster"] = cluster_gpus()
            self.ray_info = ray_facts(self.config, address, cpus)
            done = {d: sorted(q) for d, q in state.items()} if docs is None else {}
            try:
                self._pass(self.config, docs, cpus, run.rows.docs_scheduled, done)
            except Exception as exc:  # a document that kills its worker: isolate it (pipeline.distributed.isolation)
                if docs is None or not is_worker_death(exc):
                    raise
                run.worker_deaths = self._isolation(cpus).isolate(docs, self._log)
        except JobConfigError as exc:
            self._end_early(manifest, run, exc, "failed")
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded in the manifest, then re-raised
            if not isinstance(exc, Exception):  # KeyboardInterrupt / SystemExit: record, then propagate
                self._end_early(manifest, run, exc, "interrupted")
                raise
            return exc
        finally:
            if started_here:
                record.write()  # again: Ray starts some of its agents after init returns
                ray.shutdown()
                record.stop_leftovers()
        return None

    def _pass(self, config: JobConfig, docs, cpus: float, scheduled: int | None, done=None, alone=False) -> None:
        """One Ray Data pass over ``docs`` (or the Ray input less ``done``), committed as it comes."""
        commit = self.model_source.get("commit")  # every actor loads the commit the driver resolved
        ds = build_dataset(config, docs, done or {}, self.run_id, cpus, self.score, commit, one_call_per_actor=alone)
        self._commit_results(ds, scheduled)

    def _isolation(self, cpus: float) -> Isolation:
        committer = sink.BatchCommitter(self.out.data_location, self.config.fingerprint())
        rows = RowMaker(job_fields(self.config, self.run_id), self.settings, list(self.config.sweep), None)
        run_pass = lambda config, docs: self._pass(config, docs, cpus, docs.num_rows, alone=True)  # noqa: E731

        data, settings, retry = self.out.data_location, self.settings, self.config.retry_errors  # read per pass
        missing = lambda docs: sink.uncommitted(docs, sink.committed_state(data), settings, retry)  # noqa: E731
        return Isolation(self.config, run_pass, missing, lambda t: committer.commit_all([t]), rows)

    def _log(self, message: str) -> None:
        if self.echo:
            print(message, file=sys.stderr, flush=True)

    def _commit_results(self, ds, docs_scheduled: int | None) -> None:
        """Drive the pipeline and commit each document's rows on the driver as it arrives; rows
        already received are committed even when the run fails part-way (they are whole documents).
        No prefetch: Ray's default (one block) hands a block on only once the next one has arrived."""
        printer = _progress_printer(docs_scheduled) if self.echo else None
        committer = sink.BatchCommitter(
            self.out.data_location, self.config.fingerprint(), self.config.rows_per_file, on_commit=printer
        )
        committer.commit_all(ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0))

    def _record_end(
        self, manifest: dict, run: RunRecord, error: BaseException | None, this_run: pa.Table, final
    ) -> None:
        """The run's end in the manifest once its rows are committed and checked (``final``: the
        output's committed state)."""
        run.end("failed" if error is not None else "completed", now_iso(), None if error is None else describe(error))
        run.ray = self.ray_info
        run.gpu["actor_devices"] = sorted({d for d in this_run.column("device").to_pylist() if d})
        manifest["totals"] = {"rows": final.rows, "docs": len(final.answered), "rows_with_error": _with_error(final)}

    def _end_early(self, manifest: dict, run: RunRecord, exc: BaseException, status: str) -> None:
        run.end(status, now_iso(), describe(exc))
        self._write(manifest)

    def _failure(self, error: BaseException, committed: int | None) -> str:
        """One sentence for a run that failed part-way: what, how much is safe, what to do."""
        done = f"after committing {committed} rows" if committed is not None else "(its committed rows are kept)"
        hint = storage_hint(error)
        where = (
            f"details in {self.out.manifest_location}"
            if self.manifest_error is None
            else f"the manifest could not be updated ({self.manifest_error})"
        )
        return (
            f"run {self.run_id} failed {done}: {describe(error)}"
            + (f"; {hint}" if hint else "")
            + f"; {where}; rerun the same command to resume"
        )

    def _finish(self, manifest, run: RunRecord, committed, expected, error) -> RunResult:
        data = self.out.data_location
        try:
            removed = sink.dedupe(data, self.config.fingerprint()) if error is None else 0
            final = sink.committed_state(data)
            this_run = sink.read_committed(data, self.run_id)
        except Exception as exc:  # noqa: BLE001 - the output cannot be read back: say so, keep the first error
            self._end_early(manifest, run, error or exc, "failed")
            raise JobFailed(self._failure(error or exc, None)) from (error or exc)
        missing = None if expected is None else sum(1 for d, q in expected if q not in final.answered.get(d, ()))
        wall = time.perf_counter() - self.t0
        summary = summarize(this_run, wall, data.uri, self.config.compression.query_aware, rows_skipped=committed.keys)
        rows = run.rows
        rows.written, rows.ok, rows.failed = this_run.num_rows, summary.rows_ok, summary.rows_failed
        rows.duplicates_removed, rows.missing, rows.committed_total = removed, missing, final.rows
        run.wall_s, run.summary = round(wall, 3), summary.as_dict()
        self._record_end(manifest, run, error, this_run, final)
        self._write(manifest)
        if error is not None:
            raise JobFailed(self._failure(error, this_run.num_rows)) from error
        if self.echo:
            print(format_summary(summary, f"{self.config.job} run {self.run_id}"), flush=True)
            if missing:
                print(f"WARNING: {missing} expected rows are missing from {data}", flush=True)
            if run.worker_deaths:
                ids = ", ".join(d["doc_id"] for d in run.worker_deaths)
                print(f"documents that killed their worker every time (rows with error): {ids}", flush=True)
        return RunResult(
            run_id=self.run_id,
            output_dir=self.out.path,
            data_dir=self.out.data,
            manifest_path=self.out.manifest_path,
            docs_input=rows.docs_input,
            docs_skipped=rows.docs_skipped or 0,
            docs_scheduled=rows.docs_scheduled,
            rows_written=this_run.num_rows,
            duplicates_removed=removed,
            missing_rows=missing,
            summary=summary,
            total_rows=final.rows,
            wall_s=wall,
            rows_with_error=_with_error(final),
            docs_changed=rows.docs_changed,
            extra={"ray": self.ray_info, "normalise": self.mode, "calibration": self.calibration},
        )


def _with_error(state: sink.Committed) -> int:
    """Committed rows whose ``error`` is set."""
    return state.rows - sum(len(v) for v in state.succeeded.values())
