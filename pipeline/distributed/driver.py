"""The batch-job driver: input → normalised documents → Ray actor pool → committed Parquet.

``run_job(JobConfig)`` does, in this order (everything that can be wrong with the configuration
fails before Ray starts, with :class:`JobConfigError` naming the field):

Input and output may be local paths or ``s3://`` / ``gs://`` URIs (:mod:`pipeline.storage`).

1. **Output check**: ``output`` must be a new directory, an empty one, or one written by an
   earlier run of the *same* configuration (its ``manifest.json`` records the settings that define
   a result -- model, method, budgets, decoding, prompts; see ``JobConfig.identity``).
2. **Input** (:mod:`pipeline.distributed.inputs`): documents are normalised to
   ``DOCUMENT_SCHEMA`` (one row per document, its questions in lists), so that all question rows of a document travel in one batch and share one compressed
   context. ``normalise="driver"`` (the default for built-in samples, JSONL, ``datasets``
   directories, hub datasets and Parquet up to 256 MiB) reads and normalises on the driver with
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
   num_gpus=gpus_per_actor, num_cpus=cpus_per_actor, batch_size=generation.batch_size,
   batch_format="pyarrow")`` then ``write_datasink(AtomicParquetDatasink)``: Ray Data's
   ``write_parquet`` with an atomic commit per file (see :mod:`pipeline.distributed.sink`), so files
   appear one by one as batches finish and a driver killed at any moment leaves only whole files.
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

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from pipeline.data.normalise import normalise_batch
from pipeline.data.schema import SCHEMA_VERSION
from pipeline.distributed import sink
from pipeline.distributed.inputs import (
    add_instruction_column,
    apply_instruction,
    check_ray_input,
    choose_normalise,
    drop_done,
    input_location,
    instruction_mapping,
    load_documents,
)
from pipeline.distributed.rundir import (  # noqa: F401 - re-exported: JobConfigError, MANIFEST, DATA_DIR
    DATA_DIR,
    LOCK,
    MANIFEST,
    JobConfigError,
    OutputDir,
    _cluster_gpus,
    _host,
    _now,
    _versions,
    _write_json,
    new_run_id,
)
from pipeline.job_config import JobConfig
from pipeline.summary import RunSummary, format_summary, summarize

logger = logging.getLogger(__name__)


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
    total_rows: int
    wall_s: float
    extra: dict = field(default_factory=dict)


def check_model(config: JobConfig) -> None:
    """Fail fast on a model that cannot be found -- only where the actors will run on this machine
    (a local Ray); on a cluster the path may exist on the workers only."""
    if config.engine_factory is not None or config.ray_address or os.environ.get("RAY_ADDRESS"):
        return
    from pipeline.engine.loading import (
        SHORT_NAMES,
        ModelNotFoundError,
        bundled_gguf,
        resolve_model_path,
    )

    try:
        if config.model.name.lower() in SHORT_NAMES:
            bundled_gguf(config.model.name.lower())
        else:
            resolve_model_path(config.model)  # for paths: checks files only; hub ids: nothing to check offline
    except ModelNotFoundError as exc:
        raise JobConfigError("model.name", str(exc)) from exc


# ---------------------------------------------------------------------- ray
def ensure_ray(config: JobConfig) -> tuple[bool, str]:
    """Connect to (or start) Ray; returns (started here, address description)."""
    import ray

    if ray.is_initialized():
        return False, "already initialised in this process"
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False, address
    # workers import pipeline (and an engine_factory module) the way this driver does, installed or not
    import pipeline

    paths = [str(Path(pipeline.__file__).resolve().parents[1]), os.getcwd(), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    ray.init(address="local", include_dashboard=False, runtime_env={"env_vars": env})
    return True, "local (started by this job)"


def _check_resources(config: JobConfig, started_here: bool) -> float:
    """Resolve cpus per actor and fail fast when a local Ray cannot ever schedule an actor."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    max_cpus = max((r.get("CPU", 0.0) for r in nodes), default=0.0)
    max_gpus = max((r.get("GPU", 0.0) for r in nodes), default=0.0)
    cpus = config.resolved_cpus_per_actor(max_cpus or None)
    problems = []
    if cpus > max_cpus:
        problems.append(("cpus_per_actor", f"{cpus:g} CPUs per actor, but the largest node has {max_cpus:g}"))
    if config.gpus_per_actor > max_gpus:
        problems.append(("gpus_per_actor", f"{config.gpus_per_actor:g} GPUs per actor, but the largest node has {max_gpus:g}"))
    for field_name, message in problems:
        if started_here:
            raise JobConfigError(field_name, message)
        logger.warning("%s: %s (waiting for the cluster to scale up)", field_name, message)
    return cpus


def _blocks(table: pa.Table, batch_size: int) -> list[pa.Table]:
    """One block per actor batch; documents of similar length batched together."""
    order = list(range(table.num_rows))
    if batch_size > 1 and table.num_rows > 1:
        lengths = [len(c) if c else 0 for c in table.column("context").to_pylist()]
        order.sort(key=lambda i: lengths[i])
    # take() copies: each block owns its buffers (a slice would ship the whole table's buffers)
    return [table.take(pa.array(order[i:i + batch_size], pa.int64())) for i in range(0, len(order), batch_size)]


def build_dataset(config: JobConfig, docs: pa.Table | None, done: dict[str, list[str]], run_id: str, cpus: float):
    """The lazy Ray Dataset: documents → Predictor rows (not executed yet)."""
    import ray
    from ray.data import ActorPoolStrategy

    from pipeline.distributed.predictor import Predictor

    if docs is not None:
        blocks = _blocks(docs, config.batch_size)
        # from_blocks keeps one block per actor batch and needs no remote tasks (from_arrow runs one per table)
        ds = ray.data.from_blocks(blocks) if hasattr(ray.data, "from_blocks") else ray.data.from_arrow(blocks)
    else:
        location = input_location(config)
        cols = check_ray_input(config)
        ds = ray.data.read_parquet(location.path, filesystem=location.fs, file_extensions=["parquet", "pq"])
        mapping = config.columns
        if config.instruction is not None:
            ds = ds.map_batches(add_instruction_column, fn_kwargs={"instruction": config.instruction},
                                batch_format="pyarrow")
            mapping = instruction_mapping(config)
        if cols["listed"]:
            ds = ds.map_batches(normalise_batch, fn_kwargs={"mapping": mapping}, batch_format="pyarrow")
        else:
            ds = ds.groupby(cols["id"]).map_groups(normalise_batch, fn_kwargs={"mapping": mapping},
                                                   batch_format="pyarrow")
        if config.instruction is not None:
            ds = ds.map_batches(apply_instruction, fn_kwargs={"instruction": config.instruction},
                                batch_format="pyarrow")
        ds = ds.map_batches(drop_done, fn_kwargs={"done": done}, batch_format="pyarrow")
    row_fields = {
        "run_id": run_id, "job": config.job, "model": config.model.name, "method": config.compression.method,
        "cache_size": config.compression.cache_size, "budget": config.compression.budget,
    }
    gpu_args = {"num_gpus": config.gpus_per_actor} if config.gpus_per_actor > 0 else {}
    return ds.map_batches(
        Predictor,
        fn_constructor_kwargs={
            "model": config.model.model_dump(mode="json"),
            "compression": config.compression.model_dump(mode="json"),
            "generation": config.generation.model_dump(mode="json"),
            "row_fields": row_fields,
            "engine_factory": config.engine_factory,
            "faults": config.faults.model_dump(mode="json"),
            "sweep": [c.model_dump(mode="json") for c in config.sweep],
            "oom_retry_cache_size": config.oom_retry_cache_size,
        },
        compute=ActorPoolStrategy(min_size=config.min_actors, max_size=config.max_actors),
        num_cpus=cpus,
        batch_size=config.batch_size,
        batch_format="pyarrow",
        **gpu_args,
    )


# ---------------------------------------------------------------------- the job
def _finish_manifest_quickly(out: OutputDir, manifest: dict, run: dict, exc: BaseException, status: str) -> None:
    run.update({"status": status, "ended_at": _now(), "error": f"{type(exc).__name__}: {exc}"[:4000]})
    manifest["updated_at"] = _now()
    _write_json(out.manifest_location, manifest)


def run_job(config: JobConfig, *, echo: bool = True) -> RunResult:
    """Run (or resume) a batch job; see the module docstring. Prints the summary when ``echo``."""
    t0 = time.perf_counter()
    run_id = new_run_id()
    out = OutputDir(config.output)
    manifest = out.check(config)
    mode = choose_normalise(config)
    docs = load_documents(config) if mode == "driver" else None
    if mode == "ray":
        check_ray_input(config)
    try:
        import ray

        ray_running = ray.is_initialized()
    except ImportError:  # pragma: no cover
        ray_running = False
    if not ray_running:
        check_model(config)

    out.lock()
    try:
        return _run_locked(config, out, manifest, docs, mode, run_id, t0, echo)
    finally:
        out.unlock()


def _run_locked(config, out: OutputDir, manifest, docs, mode, run_id, t0, echo) -> RunResult:
    manifest = out.check(config)  # again, now that no other run can change the directory
    out.data_location.makedirs()
    debris = sink.remove_debris(out.data_location)
    if manifest is None:
        manifest = {
            "schema_version": SCHEMA_VERSION, "job": config.job, "output": out.location.uri, "data": DATA_DIR,
            "identity": config.identity(), "fingerprint": config.fingerprint(), "created_at": _now(), "runs": [],
        }
    for old in manifest["runs"]:
        if old.get("status") == "running":  # its driver died without updating the manifest
            old["status"] = "interrupted"
    committed = sink.committed_state(out.data_location)
    state = committed.succeeded if config.retry_errors else committed.answered

    expected_keys: set[tuple[str, str]] | None = None
    docs_input = docs_skipped = docs_scheduled = None
    if docs is not None:
        doc_ids = docs.column("doc_id").to_pylist()
        qids = docs.column("question_ids").to_pylist()
        expected_keys = {(d, q) for d, qs in zip(doc_ids, qids) for q in qs}
        keep = [not committed.done(d, qs, config.retry_errors) for d, qs in zip(doc_ids, qids)]
        docs = docs.filter(pa.array(keep, pa.bool_()))
        docs_input, docs_scheduled = len(doc_ids), docs.num_rows
        docs_skipped = docs_input - docs_scheduled
    run = {
        "run_id": run_id, "status": "running", "started_at": _now(), "ended_at": None,
        "config": config.model_dump(mode="json"), "normalise": mode, "host": _host(), "versions": _versions(),
        "gpu": {}, "temporary_files_removed": debris,
        "rows": {"committed_before": committed.rows, "docs_input": docs_input, "docs_skipped": docs_skipped,
                 "docs_scheduled": docs_scheduled},
    }
    manifest["runs"].append(run)
    manifest["updated_at"] = _now()
    _write_json(out.manifest_location, manifest)

    ray_info: dict = {}
    error: BaseException | None = None
    started_here = False
    try:
        if docs is None or docs.num_rows > 0:
            import ray

            started_here, address = ensure_ray(config)
            try:
                cpus = _check_resources(config, started_here)
                resources = ray.cluster_resources()
                run["gpu"]["cluster"] = _cluster_gpus()
                ray_info = {"address": address, "version": ray.__version__,
                            "cluster_cpus": resources.get("CPU"), "cluster_gpus": resources.get("GPU", 0.0),
                            "cpus_per_actor": cpus, "gpus_per_actor": config.gpus_per_actor,
                            "actors": [config.min_actors, config.max_actors]}
                done = {d: sorted(q) for d, q in state.items()} if docs is None else {}
                ds = build_dataset(config, docs, done, run_id, cpus)
                ds.write_datasink(sink.AtomicParquetDatasink(out.data_location, run_id, config.rows_per_file),
                                  ray_remote_args={"num_cpus": 0})
            finally:
                if started_here:
                    ray.shutdown()
    except JobConfigError as exc:
        _finish_manifest_quickly(out, manifest, run, exc, "failed")
        raise
    except BaseException as exc:  # noqa: BLE001 - recorded in the manifest, then re-raised
        error = exc
        if not isinstance(exc, Exception):  # KeyboardInterrupt / SystemExit: record, then propagate
            _finish_manifest_quickly(out, manifest, run, exc, "interrupted")
            raise

    removed = sink.dedupe(out.data_location, run_id)
    final = sink.committed_state(out.data_location)
    missing = None
    if expected_keys is not None:
        missing = sum(1 for d, q in expected_keys if q not in final.answered.get(d, ()))
    this_run = sink.read_committed(out.data_location, run_id)
    wall = time.perf_counter() - t0
    summary = summarize(this_run, wall, out.data_location.uri, config.compression.query_aware, rows_skipped=committed.rows)
    devices = sorted({d for d in this_run.column("device").to_pylist() if d})
    run.update({
        "status": "failed" if error is not None else "completed", "ended_at": _now(), "wall_s": round(wall, 3),
        "ray": ray_info, "error": None if error is None else f"{type(error).__name__}: {error}"[:4000],
    })
    run["gpu"]["actor_devices"] = devices
    run["rows"].update({"written": this_run.num_rows, "ok": summary.rows_ok, "failed": summary.rows_failed,
                        "duplicates_removed": removed, "missing": missing, "committed_total": final.rows})
    run["summary"] = summary.as_dict()
    manifest["updated_at"] = _now()
    manifest["totals"] = {"rows": final.rows, "docs": len(final.answered),
                          "rows_with_error": final.rows - sum(len(v) for v in final.succeeded.values())}
    _write_json(out.manifest_location, manifest)
    if error is not None:
        detail = str(error).strip().splitlines()
        raise JobFailed(
            f"run {run_id} failed after committing {this_run.num_rows} rows ({type(error).__name__}: "
            f"{' '.join(detail[:3])[:600]}); details in {out.manifest_location}; rerun the same command to resume"
        ) from error
    if echo:
        print(format_summary(summary, f"{config.job} run {run_id}"), flush=True)
        if missing:
            print(f"WARNING: {missing} expected rows are missing from {out.data_location}", flush=True)
    return RunResult(
        run_id=run_id, output_dir=out.path, data_dir=out.data, manifest_path=out.manifest_path,
        docs_input=docs_input, docs_skipped=docs_skipped or 0, docs_scheduled=docs_scheduled,
        rows_written=this_run.num_rows, duplicates_removed=removed, missing_rows=missing, summary=summary,
        total_rows=final.rows, wall_s=wall, extra={"ray": ray_info, "normalise": mode},
    )
