"""Where a job runs: connecting to (or starting) Ray, checking that its actors can ever be scheduled
and that its model exists, and what the manifest records about the cluster."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from pathlib import Path

import psutil
import ray

import pipeline
from pipeline.distributed.config import JobConfig
from pipeline.distributed.rundir import JobConfigError
from pipeline.engine.config import ModelConfig
from pipeline.engine.loading import (
    SHORT_NAMES,
    ModelNotFoundError,
    RemoteCodeRefused,
    bundled_gguf,
    check_remote_code,
    resolve_model_path,
)
from pipeline.engine.model_source import check_hub, check_object_store, hub_offline, kind_of

logger = logging.getLogger(__name__)


def check_model(config: JobConfig) -> dict:
    """Fail fast, before Ray starts, on a model that cannot be had or would need its own code without
    ``trust_remote_code``; returns where it comes from (for the manifest). See :func:`check_model_source`."""
    if config.engine_factory is not None:
        return {"kind": "engine_factory", "name": config.model.name}
    return check_model_source(config.model, bool(config.ray_address or os.environ.get("RAY_ADDRESS")))


def check_model_source(model: ModelConfig, remote: bool) -> dict:
    """A Hub id or ``s3://`` / ``gs://`` directory is asked with a metadata call or a listing (no weights)
    and its Hub revision is resolved to a commit; a local path is checked only where the actors run on
    this machine (``remote`` False: a local Ray): on a cluster it may exist on the workers only.
    Raises :class:`JobConfigError` naming ``model.name`` or ``model.trust_remote_code``."""
    kind = kind_of(model.name, SHORT_NAMES)
    try:
        if kind == "hub" and remote and hub_offline():  # the workers' caches may hold it, the driver's not
            return {"kind": kind, "id": model.name, "revision": model.revision, "offline": True, "checked": False}
        if kind == "hub":
            facts = check_hub(model.name, model.revision, model.trust_remote_code)
            check_remote_code(Path(facts.pop("config_file")), model)
            return facts
        if kind == "object_store":
            facts = check_object_store(model.name, model.trust_remote_code)
            check_remote_code(facts.pop("config"), model)
            return facts
        if kind == "bundled":
            return {"kind": kind, "name": model.name, "file": str(bundled_gguf(model.name.lower()))}
        if not remote:
            resolve_model_path(model)
        return {"kind": kind, "path": model.name}
    except ModelNotFoundError as exc:
        raise JobConfigError("model.name", str(exc)) from exc
    except RemoteCodeRefused as exc:
        raise JobConfigError("model.trust_remote_code", str(exc)) from exc


def ensure_ray(ray_address: str | None = None) -> tuple[bool, str]:
    """Connect to ``ray_address`` (or $RAY_ADDRESS), or start a local Ray; returns (started here,
    address description)."""
    if ray.is_initialized():
        return False, "already initialised in this process"
    address = ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        with _keeping_sigterm_handler():
            ray.init(address=address, log_to_driver=True)
        return False, address
    # workers import pipeline (and an engine_factory module) the way this driver does, installed or not
    paths = [str(Path(pipeline.__file__).resolve().parents[1]), os.getcwd(), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    with _keeping_sigterm_handler():
        ray.init(address="local", include_dashboard=False, runtime_env={"env_vars": env})
    return True, "local (started by this job)"


@contextlib.contextmanager
def _keeping_sigterm_handler():
    """``ray.init`` replaces the driver's SIGTERM handler with ``sys.exit(15)``; a handler the caller
    installed stays (without one, Ray's is kept: it still runs the cleanup in ``finally`` blocks)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


def check_resources(config: JobConfig, started_here: bool) -> float:
    """Resolve cpus per actor and fail fast when a local Ray cannot ever schedule an actor."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    max_cpus = max((r.get("CPU", 0.0) for r in nodes), default=0.0)
    max_gpus = max((r.get("GPU", 0.0) for r in nodes), default=0.0)
    cpus = config.resolved_cpus_per_actor(max_cpus or None)
    problems = []
    if cpus > max_cpus:
        problems.append(("cpus_per_actor", f"{cpus:g} CPUs per actor, but the largest node has {max_cpus:g}"))
    if config.gpus_per_actor > max_gpus:
        problems.append(
            ("gpus_per_actor", f"{config.gpus_per_actor:g} GPUs per actor, but the largest node has {max_gpus:g}")
        )
    for field_name, message in problems:
        if started_here:
            raise JobConfigError(field_name, message)
        logger.warning("%s: %s (waiting for the cluster to scale up)", field_name, message)
    return cpus


def cluster_gpus() -> list[dict]:
    """GPUs per alive Ray node (count and Ray's detected accelerator type), without importing torch."""
    out = []
    for node in ray.nodes():
        resources = node.get("Resources", {})
        if node.get("Alive") and resources.get("GPU"):
            kinds = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
            out.append({"node": node.get("NodeManagerAddress"), "gpus": resources["GPU"], "type": kinds or None})
    return out


def ray_facts(config: JobConfig, address: str, cpus: float) -> dict:
    """What the manifest records about the cluster this run used."""
    resources = ray.cluster_resources()
    return {
        "address": address,
        "version": ray.__version__,
        "cluster_cpus": resources.get("CPU"),
        "cluster_gpus": resources.get("GPU", 0.0),
        "cpus_per_actor": cpus,
        "gpus_per_actor": config.gpus_per_actor,
        "actors": [config.min_actors, config.max_actors],
    }


# ---------------------------------------------------------------------- local Ray processes
SESSIONS_DIR = "ray-sessions"  # under the pipeline's cache directory (engine.loading.default_cache_dir)


def _identity(proc: psutil.Process) -> dict:
    return {"pid": proc.pid, "started": proc.create_time(), "name": proc.name()}


def _alive(entry: dict) -> psutil.Process | None:
    """The process of a record entry, if the same process (pid and start time) still runs."""
    try:
        proc = psutil.Process(entry["pid"])
        return proc if abs(proc.create_time() - entry["started"]) < 1e-3 else None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class LocalRayRecord:
    """The processes of a local Ray this driver started, recorded by PID and start time so that a
    later run can stop them if this driver dies without shutting them down (a SIGKILL leaves Ray's
    DashboardAgent and RuntimeEnvAgent running). Never matches processes by name."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"driver-{os.getpid()}.json"

    def write(self) -> None:
        me = psutil.Process()
        record = {"driver": _identity(me), "processes": [_identity(p) for p in me.children(recursive=True)]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record))

    def stop_leftovers(self) -> int:
        """After ``ray.shutdown()``: stop what of this session still runs; returns how many."""
        stopped = _stop(json.loads(self.path.read_text())["processes"]) if self.path.is_file() else 0
        self.path.unlink(missing_ok=True)
        return stopped


def stop_dead_sessions(directory: Path) -> int:
    """Stop the recorded processes of local Ray sessions whose driver no longer runs; returns how many."""
    stopped = 0
    for path in sorted(directory.glob("driver-*.json")) if directory.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if _alive(record["driver"]) is None:
            stopped += _stop(record["processes"])
            path.unlink(missing_ok=True)
    if stopped:
        logger.warning("stopped %d processes left by the local Ray of a driver that died", stopped)
    return stopped


def _stop(entries: list[dict], grace_s: float = 5.0) -> int:
    procs = [p for p in (_alive(e) for e in entries) if p is not None]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return len(procs)
