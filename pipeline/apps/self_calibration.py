"""The learned scorer calibrated for the user's model on the user's own documents, before a batch job
answers (``--calibrate auto``, the default).

A method with the ``kvzap`` scorer or the ``shares`` allocation needs a KVzap file made for the model
(:mod:`pipeline.engine.kvzap_file`). When the job names none and none ships for the model, the file is
looked up where an earlier run of this output put it (``OUT/calibration/kvzap-<model>.safetensors``
for a local output; the pipeline's cache directory for an object-store output, with a copy under
``OUT/calibration/``); when there is none, :func:`calibrate_for_job` makes it: ``--calibration-docs``
documents drawn from the job's own input (at their real lengths), their true KVzip+ scores computed
by the model's reconstruction passes on Ray actors (:mod:`pipeline.apps.calibrate_kvzap`), one
predictor per layer fitted on the driver with the defaults of ``jobs/calibrate_kvzap.py`` and checked
on the documents held out. Every actor then loads that one file (its bytes travel with the actors'
arguments). With ``--calibrate off`` the job's configuration is refused instead (exit 2), naming the
command that makes a file and the calibration-free methods (:func:`pipeline.engine.kvzap_file.resolve_kvzap`).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import time
from pathlib import Path

import pyarrow as pa
import ray

from pipeline.apps.calibrate_kvzap import KVzapCalibrationJob, collect_targets
from pipeline.data.locations import resolve
from pipeline.distributed.cluster import check_model, check_resources, ensure_ray
from pipeline.distributed.config import JobConfig
from pipeline.distributed.inputs import choose_normalise, load_documents
from pipeline.distributed.rundir import CALIBRATION_DIR, JobConfigError, OutputDir
from pipeline.engine.kvzap_file import read_metadata, shipped_kvzap, write_kvzap
from pipeline.engine.loading import default_cache_dir
from pipeline.eval.kvzap_calibration import fit

_DEFAULTS = KVzapCalibrationJob.model_fields  # the calibration job's defaults, used as they are
SHARE_SIZES, SAMPLE_TOKENS = _DEFAULTS["share_sizes"].default, _DEFAULTS["sample_tokens"].default
VALIDATION, SEED = _DEFAULTS["validation"].default, _DEFAULTS["seed"].default


def needs_calibration(config: JobConfig) -> bool:
    """A setting of the job needs a KVzap file, names none, and none ships for the model."""
    return any(
        s.compresses and s.needs_kvzap_model and s.kvzap_model is None and shipped_kvzap(config.model.name) is None
        for s in config.compression_settings()
    )


def file_name(config: JobConfig) -> str:
    """``kvzap-<model>[@revision].safetensors`` with the name made safe for a file system."""
    name = config.model.name + (f"@{config.model.revision}" if config.model.revision else "")
    return "kvzap-" + re.sub(r"[^A-Za-z0-9._@-]+", "--", name).strip("-")[:120] + ".safetensors"


def local_file(config: JobConfig) -> Path:
    """Where this output's calibration file lives on the driver."""
    out = resolve(config.output)
    if out.is_local:
        return Path(out.path) / CALIBRATION_DIR / file_name(config)
    digest = hashlib.sha256(out.uri.encode()).hexdigest()[:16]
    return default_cache_dir() / "kvzap" / digest / file_name(config)


def with_file(config: JobConfig, path: Path) -> JobConfig:
    """``config`` with ``path`` as the KVzap file of every setting that needs one and names none."""

    def fill(setting):
        needs = setting.compresses and setting.needs_kvzap_model and setting.kvzap_model is None
        return setting.model_copy(update={"kvzap_model": path}) if needs else setting

    return config.model_copy(update={"compression": fill(config.compression), "sweep": [fill(s) for s in config.sweep]})


def calibrate_for_job(config: JobConfig, log) -> tuple[JobConfig, dict | None]:
    """The job's config with its KVzap file (reused or made now) and what the manifest records of it;
    ``(config, None)`` when the job needs no calibration. Raises :class:`JobConfigError` (exit 2)."""
    if not needs_calibration(config):
        return config, None
    path = local_file(config)
    if not path.is_file():
        _fetch_output_copy(config, path)
    if path.is_file():
        settings = read_metadata(path).get("settings", {})
        facts = {"path": str(path), "reused": True, "documents": settings.get("documents"), "seconds": 0.0}
        return with_file(config, path), facts
    if getattr(config, "calibrate", "off") == "off":  # the config's validator has refused it already
        return config, None
    OutputDir(config.output).check(with_file(config, path))  # a refused output fails before the work
    check_model(config)  # a model that cannot be had fails here (exit 2), not in the calibration's actors
    facts = _calibrate(config, path, log)
    return with_file(config, path), facts


def _fetch_output_copy(config: JobConfig, path: Path) -> None:
    """An object-store output's calibration copy, brought to the driver's cache (nothing when absent)."""
    out = resolve(config.output)
    if out.is_local:
        return
    copy = out.child(CALIBRATION_DIR, file_name(config))
    if copy.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(copy.read_bytes())


def sample_documents(docs: pa.Table, count: int, seed: int = SEED) -> list[dict]:
    """``count`` documents drawn at random (seeded) from those without an input error."""
    usable = [d for d in docs.to_pylist() if not d.get("input_error") and (d.get("context") or "").strip()]
    picked = random.Random(seed).sample(usable, min(count, len(usable)))
    return [{"doc_id": str(d["doc_id"]), "context": d["context"], "kind": "input", "length": None} for d in picked]


def _calibrate(config: JobConfig, path: Path, log) -> dict:
    t0 = time.perf_counter()
    if choose_normalise(config) != "driver":
        raise JobConfigError(
            "calibrate",
            "this input is normalised in Ray tasks (a large Parquet input), so the job cannot sample it for "
            "calibration: run jobs/calibrate_kvzap.py on a sample and pass --kvzap-model",
        )
    docs = sample_documents(load_documents(config), config.calibration_docs)
    if len(docs) < 2:
        raise JobConfigError(
            "calibration_docs", f"calibration needs at least 2 usable documents, the input has {len(docs)}"
        )
    log(f"calibrating the learned scorer for {config.model.name} on {len(docs)} of your documents (KVzip+ passes)")
    started_here, _ = ensure_ray(config.ray_address)
    try:
        cpus = check_resources(config, started_here)
        model = config.model.model_dump(mode="json")
        args = (SAMPLE_TOKENS, SHARE_SIZES, SEED)
        targets, fingerprint = collect_targets(model, docs, config.max_actors, cpus, config.gpus_per_actor, args, log)
    finally:
        if started_here:
            ray.shutdown()
    held = set(random.Random(SEED).sample([t.doc_id for t in targets], max(1, round(VALIDATION * len(targets)))))
    train, held_out = [t for t in targets if t.doc_id not in held], [t for t in targets if t.doc_id in held]
    kvzap, report = fit(train, held_out, SHARE_SIZES, seed=SEED, progress=log)
    seconds = round(time.perf_counter() - t0, 1)
    tokens = [t.tokens for t in targets]
    settings = {"source": "job input", "documents": [t.doc_id for t in targets], "tokens": tokens, "seconds": seconds}
    _write(config, path, kvzap, fingerprint, report, settings)
    mean = report["mean"]
    log(f"calibrated in {seconds:.0f} s: held-out R2 {mean['r2']:.3f}, Spearman {mean['spearman']:.3f}; {path}")
    return {"path": str(path), "reused": False, "documents": settings["documents"], "tokens": tokens,
            "fit": mean, "seconds": seconds}  # fmt: skip


def _write(config: JobConfig, path: Path, kvzap, fingerprint: dict, report: dict, settings: dict) -> None:
    """The file, written under a temporary name and renamed (a killed run leaves no half file), plus
    its copy under an object-store output."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    write_kvzap(tmp, kvzap, config.model.name, fingerprint, report, settings)
    os.replace(tmp, path)
    out = resolve(config.output)
    if not out.is_local:
        out.child(CALIBRATION_DIR, file_name(config)).write_bytes(path.read_bytes())
