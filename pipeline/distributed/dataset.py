"""The lazy Ray Dataset of a job: documents -> Predictor actors -> output rows (not executed here)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy

from pipeline.data.normalise import normalise_batch
from pipeline.distributed.config import JobConfig
from pipeline.distributed.inputs import (
    add_instruction_column,
    apply_instruction,
    check_ray_input,
    drop_done,
    input_location,
    instruction_mapping,
)
from pipeline.distributed.isolation import ACTOR_TASK_RETRIES
from pipeline.distributed.predictor import Predictor, ScoreFunction, package_fingerprint, setting_of


def blocks_of(table: pa.Table, batch_size: int) -> list[pa.Table]:
    """One block per actor batch; documents of similar length batched together."""
    order = list(range(table.num_rows))
    if batch_size > 1 and table.num_rows > 1:
        lengths = [len(c) if c else 0 for c in table.column("context").to_pylist()]
        order.sort(key=lambda i: lengths[i])
    # take() copies: each block owns its buffers (a slice would ship the whole table's buffers)
    return [table.take(pa.array(order[i : i + batch_size], pa.int64())) for i in range(0, len(order), batch_size)]


def ray_documents(config: JobConfig, done: dict[str, list[str]]):
    """Documents read and normalised in Ray tasks (``normalise="ray"``), already-done ones dropped."""
    location = input_location(config)
    cols = check_ray_input(config)
    ds = ray.data.read_parquet(location.path, filesystem=location.fs, file_extensions=["parquet", "pq"])
    mapping = config.columns
    if config.instruction is not None:
        ds = ds.map_batches(
            add_instruction_column, fn_kwargs={"instruction": config.instruction}, batch_format="pyarrow"
        )
        mapping = instruction_mapping(config)
    if cols["listed"]:
        ds = ds.map_batches(normalise_batch, fn_kwargs={"mapping": mapping}, batch_format="pyarrow")
    else:
        ds = ds.groupby(cols["id"]).map_groups(normalise_batch, fn_kwargs={"mapping": mapping}, batch_format="pyarrow")
    if config.instruction is not None:
        ds = ds.map_batches(apply_instruction, fn_kwargs={"instruction": config.instruction}, batch_format="pyarrow")
    sweep = [setting_of(c).columns() for c in config.sweep]
    return ds.map_batches(drop_done, fn_kwargs={"done": done, "sweep": sweep}, batch_format="pyarrow")


def kvzap_files(config: JobConfig) -> dict[str, bytes]:
    """The bytes of every KVzap file the job's settings name, by the path the driver knows them under:
    an actor on another node, where that path does not exist, loads its own copy of the same bytes
    (a file is a few MB at most: one linear map per layer)."""
    paths = {str(s.kvzap_model) for s in config.compression_settings() if s.kvzap_model is not None}
    return {path: Path(path).read_bytes() for path in sorted(paths) if Path(path).is_file()}


def actor_env() -> dict[str, str]:
    """Environment variables of the actors, merged into the job's runtime environment (Ray keeps the
    job's other variables, e.g. ``HF_TOKEN``). ``OMP_WAIT_POLICY``: the engine answers in a thread of
    its own (:meth:`Predictor._stream`), and with OpenMP's default active waiting torch ran that
    thread's CPU work 10-15 % slower than the actor's main thread (passive: the same); OpenMP reads it
    when torch loads, before any code of ours runs in the actor. The driver's own value wins."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def job_fields(config: JobConfig, run_id: str) -> dict:
    """The columns every row of the run shares: run, job, model (``id@revision`` when pinned) and the
    job's setting (method, cache size, budget)."""
    model = config.model.name + (f"@{config.model.revision}" if config.model.revision else "")
    return {"run_id": run_id, "job": config.job, "model": model, **setting_of(config.compression).columns()}


def build_dataset(
    config: JobConfig,
    docs: pa.Table | None,
    done: dict[str, list[str]],
    run_id: str,
    cpus: float,
    score: ScoreFunction | None = None,
    model_revision: str | None = None,
    one_call_per_actor: bool = False,
):
    """The job's dataset: ``docs`` (driver-normalised) or the Ray-normalised input, then the actors.
    ``model_revision``: the Hub commit the driver resolved, which every actor loads (default: the
    configured revision); ``one_call_per_actor``: no batch waits queued on an actor (an actor that
    dies then fails only the batch it was answering: the isolation passes)."""
    batch_size = config.batch_size_for(docs.num_rows if docs is not None else None)
    if docs is not None:
        # from_blocks keeps one block per actor batch and needs no remote tasks (from_arrow runs one per table)
        ds = ray.data.from_blocks(blocks_of(docs, batch_size))
    else:
        ds = ray_documents(config, done)
    fields = job_fields(config, run_id)
    gpu_args = {"num_gpus": config.gpus_per_actor} if config.gpus_per_actor > 0 else {}
    with warnings.catch_warnings():  # Ray 2.60 has no named parameter for max_task_retries yet
        warnings.simplefilter("ignore", DeprecationWarning)
        ds = ds.map_batches(
            Predictor,
            fn_constructor_kwargs={
                "model": {**config.model.model_dump(mode="json"), "revision": model_revision or config.model.revision},
                "compression": config.compression.model_dump(mode="json"),
                "generation": config.generation.model_dump(mode="json"),
                "job_fields": fields,
                "engine_factory": config.engine_factory,
                "sweep": [c.model_dump(mode="json") for c in config.sweep],
                "oom_retry_cache_size": config.oom_retry_cache_size,
                "score": score,
                "code_fingerprint": package_fingerprint(),
                "kvzap_files": kvzap_files(config),
            },
            compute=ActorPoolStrategy(
                min_size=config.min_actors,
                max_size=config.max_actors,
                max_tasks_in_flight_per_actor=1 if one_call_per_actor else None,
            ),
            num_cpus=cpus,
            batch_size=batch_size,
            batch_format="pyarrow",
            max_task_retries=ACTOR_TASK_RETRIES,  # a batch that kills its actor twice fails its pass (isolation)
            runtime_env={"env_vars": actor_env()},
            **gpu_args,
        )
    if docs is not None:
        # every document the actor yields (one packed row) leaves as its own block at once, instead of
        # waiting in the operator's output buffer until 128 MiB or the call's end. Not on the Ray input
        # path: this execution-wide setting would also cut its read and normalise blocks into rows.
        ds.context.target_max_block_size = 1
    return ds
