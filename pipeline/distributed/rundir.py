"""The output directory of a job: its lock, its manifest and the facts a manifest records
(versions, host, GPUs). Split from :mod:`pipeline.distributed.driver`, which drives the run."""

from __future__ import annotations

import datetime as _dt
import fcntl
import getpass
import json
import os
import platform
import socket
import sys
import uuid
from pathlib import Path

from pipeline.data.schema import SCHEMA_VERSION
from pipeline.job_config import JobConfig, identity_differences

MANIFEST = "manifest.json"
DATA_DIR = "data"
LOCK = ".lock"


class JobConfigError(ValueError):
    """The job cannot start; ``field`` names the setting that is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message



# ---------------------------------------------------------------------- helpers
def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:6]}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("criticalkv-pipeline", "torch", "transformers", "ray", "pyarrow", "pydantic", "accelerate", "gguf"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _host() -> dict:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - containers without a passwd entry
        user = None
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "pid": os.getpid(),
            "user": user, "cwd": os.getcwd(), "argv": sys.argv}


def _cluster_gpus() -> list[dict]:
    """GPUs per alive Ray node (count and Ray's detected accelerator type), without importing torch."""
    import ray

    out = []
    for node in ray.nodes():
        resources = node.get("Resources", {})
        if node.get("Alive") and resources.get("GPU"):
            kinds = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
            out.append({"node": node.get("NodeManagerAddress"), "gpus": resources["GPU"], "type": kinds or None})
    return out


# ---------------------------------------------------------------------- output directory
class OutputDir:
    """The output directory: manifest, lock and committed data (see module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser().absolute()
        self.data = self.path / DATA_DIR
        self.manifest_path = self.path / MANIFEST
        self._lock_handle = None

    def load_manifest(self) -> dict | None:
        if not self.manifest_path.is_file():
            return None
        try:
            return json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise JobConfigError("output", f"{self.manifest_path} is unreadable ({exc}); use a new output directory") from exc

    def check(self, config: JobConfig) -> dict | None:
        """Refuse directories this configuration must not write into; returns the manifest."""
        if self.path.exists() and not self.path.is_dir():
            raise JobConfigError("output", f"{self.path} is a file; the output must be a directory")
        manifest = self.load_manifest()
        if manifest is None:
            if self.path.is_dir() and any(p.name != DATA_DIR and not p.name.startswith(".") for p in self.path.iterdir()):
                raise JobConfigError(
                    "output", f"{self.path} is not empty and holds no {MANIFEST} of this pipeline; "
                    "choose a new or empty directory")
            return None
        if manifest.get("schema_version") != SCHEMA_VERSION:
            raise JobConfigError(
                "output", f"{self.path} holds results of output schema version {manifest.get('schema_version')}, "
                f"this pipeline writes version {SCHEMA_VERSION}; use a new output directory")
        diffs = identity_differences(manifest.get("identity", {}), config.identity())
        if diffs:
            raise JobConfigError(
                "output", f"{self.path} holds results of a different configuration ({'; '.join(diffs[:6])}); "
                "rerun with the same settings to resume, or choose a new output directory")
        return manifest

    def lock(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        handle = open(self.path / LOCK, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise JobConfigError("output", f"another run is writing to {self.path} ({holder or 'lock held'})") from None
        handle.seek(0), handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self._lock_handle = handle

    def unlock(self) -> None:
        if self._lock_handle is not None:
            fcntl.flock(self._lock_handle, fcntl.LOCK_UN)
            self._lock_handle.close()
            self._lock_handle = None


# ---------------------------------------------------------------------- input
