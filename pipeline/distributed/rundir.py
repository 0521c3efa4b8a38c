"""The output directory of a job: its lock, its manifest and the facts a manifest records
(versions, host, GPUs). Split from :mod:`pipeline.distributed.driver`, which drives the run.

The directory is a local path or an object-storage prefix (``s3://``, ``gs://``; see
:mod:`pipeline.data.locations`). The manifest is replaced atomically on both. The run lock (``OUT/.lock``,
an ``flock``) exists only on local filesystems: object stores offer no lock, so two jobs started at
the same moment into the same prefix are not stopped; they still lose no rows (the sink's names are
per run, and the next run's dedupe keeps one row per key), but they do the work twice.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import getpass
import json
import logging
import os
import platform
import socket
import sys
import uuid
from importlib import metadata
from pathlib import Path

from pipeline.data.locations import Location, StorageError, resolve, storage_error
from pipeline.data.schema import SCHEMA_VERSION
from pipeline.distributed.config import JobConfig, identity_differences

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DATA_DIR = "data"
CALIBRATION_DIR = "calibration"  # the learned scorer calibrated on this output's input (pipeline.apps.self_calibration)
LOCK = ".lock"


class JobConfigError(ValueError):
    """The job cannot start; ``field`` names the setting that is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _canonical(location: Location) -> str:
    """A location's URI with local symlinks resolved, ending in ``/`` (for prefix tests)."""
    text = str(Path(location.path).resolve()) if location.is_local else location.uri
    return text.rstrip("/") + "/"


def check_apart(input_target: str | None, output: Location) -> None:
    """Refuse an output inside the input, or an input inside the output (local or object storage):
    a rerun would read its own rows as documents."""
    if input_target is None:
        return
    try:
        source = resolve(input_target)
    except StorageError:
        return  # the input's own check names it
    if source.is_local and not Path(source.path).exists():
        return  # a hub dataset name, or nothing there (the input's own check names it)
    a, b = _canonical(source), _canonical(output)
    if a.startswith(b) or b.startswith(a):
        where = "is the input" if a == b else ("is inside the input" if b.startswith(a) else "holds the input")
        raise JobConfigError(
            "output",
            f"{output} {where} {source}: a rerun would read the job's own output as documents; "
            "choose an output directory outside the input",
        )


# ---------------------------------------------------------------------- helpers
def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def _write_json(location: Location, data: dict) -> None:
    location.write_bytes((json.dumps(data, indent=2, default=str) + "\n").encode())


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for dist in ("criticalkv-pipeline", "torch", "transformers", "ray", "pyarrow", "pydantic", "accelerate", "gguf"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def host_facts() -> dict:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - containers without a passwd entry
        user = None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "pid": os.getpid(),
        "user": user,
        "cwd": os.getcwd(),
        "argv": sys.argv,
    }


# ---------------------------------------------------------------------- output directory
class OutputDir:
    """The output directory: manifest, lock and committed data (see module docstring)."""

    def __init__(self, path) -> None:
        try:
            self.location = resolve(path)
        except StorageError as exc:
            raise JobConfigError("output", str(exc)) from exc
        self.data_location = self.location.child(DATA_DIR)
        self.manifest_location = self.location.child(MANIFEST)
        self._lock_handle = None

    # Path for local directories, the URI string on object storage
    @property
    def path(self):
        return self.location.native()

    @property
    def data(self):
        return self.data_location.native()

    @property
    def manifest_path(self):
        return self.manifest_location.native()

    def write_manifest(self, manifest: dict) -> None:
        """Replace ``manifest.json`` (atomically, see :meth:`pipeline.data.locations.Location.write_bytes`)."""
        _write_json(self.manifest_location, manifest)

    def load_manifest(self) -> dict | None:
        try:
            if not self.manifest_location.is_file():
                return None
            return json.loads(self.manifest_location.read_bytes())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise JobConfigError(
                "output", f"{self.manifest_location} is unreadable ({exc}); use a new output directory"
            ) from exc

    def check(self, config: JobConfig) -> dict | None:
        """Refuse directories this configuration must not write into; returns the manifest."""
        check_apart(config.input, self.location)
        try:
            self.location.check_bucket()
            if self.location.is_file():
                raise JobConfigError("output", f"{self.location} is a file; the output must be a directory")
            manifest = self.load_manifest()
            entries = self.location.entries() if manifest is None else []
        except OSError as exc:  # object storage: no such bucket, no credentials, no network (FileNotFoundError too)
            raise JobConfigError("output", f"cannot access {self.location}: {storage_error(exc)}") from exc
        if manifest is None:
            names = [e.base_name for e in entries]
            if any(name not in (DATA_DIR, CALIBRATION_DIR) and not name.startswith(".") for name in names):
                raise JobConfigError(
                    "output",
                    f"{self.location} is not empty and holds no {MANIFEST} of this pipeline; "
                    "choose a new or empty directory",
                )
            return None
        if manifest.get("schema_version") != SCHEMA_VERSION:
            raise JobConfigError(
                "output",
                f"{self.location} holds results of output schema version {manifest.get('schema_version')}, "
                f"this pipeline writes version {SCHEMA_VERSION}; use a new output directory",
            )
        diffs = identity_differences(manifest.get("identity", {}), config.identity())
        if diffs:
            raise JobConfigError(
                "output",
                f"{self.location} holds results of a different configuration ({'; '.join(diffs[:6])}); "
                "rerun with the same settings to resume, or choose a new output directory",
            )
        return manifest

    def lock(self) -> None:
        if not self.location.is_local:
            logger.warning(
                "%s is on object storage, which has no locks: do not start a second run into it until this one ends",
                self.location,
            )
            return
        self.location.makedirs()
        handle = open(os.path.join(self.location.path, LOCK), "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise JobConfigError(
                "output", f"another run is writing to {self.location} ({holder or 'lock held'})"
            ) from None
        handle.seek(0), handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self._lock_handle = handle

    def unlock(self) -> None:
        if self._lock_handle is not None:
            fcntl.flock(self._lock_handle, fcntl.LOCK_UN)
            self._lock_handle.close()
            self._lock_handle = None
