"""Where inputs and outputs live: a local path or an object-storage URI, through pyarrow's filesystems.

``resolve(target)`` turns what a user passes as ``--input`` / ``--output`` into a :class:`Location`
(a pyarrow ``FileSystem`` plus a path inside it):

* a local path (``~`` expanded, made absolute) or ``file:///abs/path`` → ``LocalFileSystem``;
* ``s3://bucket/key`` → ``S3FileSystem``: credentials from pyarrow's default chain
  (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, the ``~/.aws`` files,
  an instance or pod role); the bucket's region from ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` (else
  the SDK's default); ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for S3-compatible stores such
  as MinIO (see :func:`s3_options`);
* ``gs://bucket/key`` (or ``gcs://``) → ``GcsFileSystem()``: Application Default Credentials
  (``GOOGLE_APPLICATION_CREDENTIALS``, workload identity, the metadata server).

Every call to an object store is bounded: ``$CRITICALKV_STORAGE_TIMEOUT_S`` (default 20 s) caps the
retries of a GCS request (without credentials the client otherwise retries for about 16 minutes) and
an S3 connection; and the metadata calls (:meth:`Location.info`, :meth:`Location.entries`) run in a
helper thread while the caller waits in short steps, so Ctrl-C and SIGTERM are acted on at once.

The filesystems are built directly rather than with ``FileSystem.from_uri``, which for S3 asks the
network for the bucket's region at parse time; here nothing touches the network until a file is
read or written, so a configuration can be validated offline.

Semantics the pipeline relies on (see :mod:`pipeline.distributed.sink`):

* :meth:`Location.write_bytes` is atomic on both kinds: locally a temporary sibling is written,
  fsynced and renamed over the target; on object storage a single PUT (or a multipart upload
  completed in one call) makes the object appear whole or not at all.
* Object stores have no rename and no file lock; callers that need either check ``is_local``.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TypeVar

import pyarrow.fs as pafs

T = TypeVar("T")
TMP_PREFIX = ".tmp-"  # local writes in progress (see Location.write_bytes); readers skip names starting with "."
OBJECT_STORE_SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs"}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StorageError(ValueError):
    """A location that cannot be used (unsupported scheme, malformed URI, no bucket)."""


def is_uri(target: object) -> bool:
    """True for ``scheme://...`` strings (local paths, ``Path`` objects and hub names are not)."""
    return isinstance(target, str) and _SCHEME.match(target) is not None


def s3_options(environ: os._Environ | dict | None = None) -> dict:
    """``S3FileSystem`` options from the standard AWS variables that pyarrow does not read itself:
    the region (``AWS_REGION`` / ``AWS_DEFAULT_REGION``) and an S3-compatible endpoint
    (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, e.g. ``http://minio:9000``; path-style
    addressing). Credentials are left to pyarrow's default chain (variables, files, roles)."""
    env = os.environ if environ is None else environ
    options: dict = {}
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        match = re.match(r"^(https?)://([^/]+)/?$", endpoint.strip())
        if match is None:
            raise StorageError(f"AWS_ENDPOINT_URL={endpoint!r}: expected http(s)://host[:port]")
        options["scheme"], options["endpoint_override"] = match.group(1), match.group(2)
    return options


def storage_timeout_s() -> float:
    """``$CRITICALKV_STORAGE_TIMEOUT_S`` (default 20): the retry budget of one object-store request."""
    text = os.environ.get("CRITICALKV_STORAGE_TIMEOUT_S", "").strip()
    try:
        value = float(text) if text else 20.0
    except ValueError:
        raise StorageError(f"CRITICALKV_STORAGE_TIMEOUT_S={text!r}: expected a number of seconds") from None
    if not 0 < value < 1e6:
        raise StorageError(f"CRITICALKV_STORAGE_TIMEOUT_S={text!r}: expected a positive number of seconds")
    return value


def _object_store(scheme: str) -> pafs.FileSystem:
    timeout = storage_timeout_s()
    if scheme == "s3":
        return pafs.S3FileSystem(**s3_options(), connect_timeout=timeout)
    return pafs.GcsFileSystem(retry_time_limit=datetime.timedelta(seconds=timeout))


def storage_error(exc: BaseException) -> str:
    """One short sentence for an object store's error (Google's client puts its whole retry record in
    the message): missing credentials say which ones; other messages are cut at 300 characters."""
    text = " ".join(str(exc).split())
    if "OAuth2 access token" in text:
        return (
            "no Google Cloud credentials could be found (set GOOGLE_APPLICATION_CREDENTIALS to a key file, or run "
            "where a service account or workload identity is attached)"
        )
    if "google::cloud::Status(" in text:
        text = text.split("error_info=")[0].rstrip(" ,{")
    return text if len(text) <= 300 else text[:297] + "..."


def interruptible(call: Callable[[], T]) -> T:
    """``call()`` in a helper thread while this one waits in 0.1 s steps, so that a signal handler of
    the main thread (Ctrl-C, SIGTERM) runs at once even while the call blocks in C++; the call's
    exception is raised here."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="criticalkv-storage-call")
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if "error" in result:
        raise result["error"]
    return result["value"]


@dataclass(frozen=True)
class Location:
    """A file or directory on one filesystem.

    ``uri``: the canonical form shown to users and recorded in manifests (an absolute local path,
    or ``s3://bucket/key``); ``path``: the path inside ``fs`` (``bucket/key`` on object storage).
    Two locations are equal when their ``uri`` is. Local locations are ``os.PathLike``.
    """

    uri: str
    path: str
    fs: pafs.FileSystem = field(compare=False, repr=False)

    # ------------------------------------------------------------------ naming
    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.path).suffix

    def child(self, *names: str) -> Location:
        path = "/".join([self.path.rstrip("/"), *names])
        uri = "/".join([self.uri.rstrip("/"), *names])
        if self.is_local:
            path = uri = str(Path(self.path, *names))
        return Location(uri, path, self.fs)

    def native(self) -> Path | str:
        """A ``Path`` for local locations, the URI string otherwise."""
        return Path(self.path) if self.is_local else self.uri

    def __fspath__(self) -> str:
        if not self.is_local:
            raise TypeError(f"{self.uri} is on object storage, not a local path")
        return self.path

    def __str__(self) -> str:
        return self.uri

    # ------------------------------------------------------------------ queries
    def _ask(self, what) -> object:
        """``self.fs.get_file_info(what)``: directly on a local disk, :func:`interruptible` on a store."""
        if self.is_local:
            return self.fs.get_file_info(what)
        return interruptible(lambda: self.fs.get_file_info(what))

    def info(self) -> pafs.FileInfo:
        return self._ask(self.path)

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def size(self) -> int | None:
        return self.info().size

    def entries(self, recursive: bool = False) -> list[pafs.FileInfo]:
        """Files and directories under this directory ([] when it does not exist)."""
        selector = pafs.FileSelector(self.path, allow_not_found=True, recursive=recursive)
        try:
            return list(self._ask(selector))
        except (NotADirectoryError, FileNotFoundError):
            return []

    def files(self, recursive: bool = False) -> list[pafs.FileInfo]:
        return [i for i in self.entries(recursive) if i.type == pafs.FileType.File]

    def relative(self, info: pafs.FileInfo) -> PurePosixPath:
        """``info``'s path relative to this directory."""
        return PurePosixPath(info.path).relative_to(PurePosixPath(self.path))

    def at(self, info: pafs.FileInfo) -> Location:
        """The location of an entry listed by :meth:`entries`."""
        return self.child(*self.relative(info).parts)

    def check_bucket(self) -> None:
        """Object storage: raise ``FileNotFoundError`` unless the bucket exists and can be listed
        (a missing bucket otherwise only shows up at the first write)."""
        if self.is_local:
            return
        bucket = self.path.split("/", 1)[0]
        if self._ask(bucket).type != pafs.FileType.Directory:
            raise FileNotFoundError(f"bucket {bucket!r} does not exist or is not visible with these credentials")

    # ------------------------------------------------------------------ reading and writing
    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as stream:
            return stream.read()

    def makedirs(self) -> None:
        """Create the directory and its parents (object storage: nothing to do, prefixes need no marker)."""
        if self.is_local:
            Path(self.path).mkdir(parents=True, exist_ok=True)

    def write_bytes(self, data: bytes) -> None:
        """Write the whole file atomically (see the module docstring): locally under a temporary
        sibling ``.tmp-<name>-<random>`` (names starting with ``.`` are ignored by every reader),
        fsynced, renamed over the target, then the directory fsynced."""
        if not self.is_local:
            with self.fs.open_output_stream(self.path) as stream:
                stream.write(data)
            return
        target = Path(self.path)
        tmp = target.with_name(f"{TMP_PREFIX}{target.stem}-{uuid.uuid4().hex[:8]}{target.suffix}")
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_directory(target.parent)

    def delete(self) -> None:
        """Delete this file; a file already gone is not an error."""
        try:
            self.fs.delete_file(self.path)
        except FileNotFoundError:
            pass


def fsync_directory(path: str | os.PathLike) -> None:
    """Make a rename or delete in a local directory durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def local(path: str | os.PathLike) -> Location:
    text = str(Path(path).expanduser().absolute())
    return Location(text, text, pafs.LocalFileSystem())


def resolve(target: str | os.PathLike | Location) -> Location:
    """The :class:`Location` of a local path or a ``file://``, ``s3://`` or ``gs://`` URI."""
    if isinstance(target, Location):
        return target
    if not is_uri(target):
        return local(target)
    scheme, rest = target.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/"):
            raise StorageError(f"{target}: a file:// URI needs an absolute path (file:///abs/path)")
        return local(rest)
    kind = OBJECT_STORE_SCHEMES.get(scheme)
    if kind is None:
        raise StorageError(
            f"{target}: unsupported URI scheme {scheme!r}; use a local path, s3://bucket/key or gs://bucket/key"
        )
    if "?" in rest or "#" in rest:
        raise StorageError(
            f"{target}: query strings are not supported; configure the store with its environment "
            "(e.g. AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, GOOGLE_APPLICATION_CREDENTIALS)"
        )
    path = "/".join(p for p in rest.split("/") if p)
    if not path:
        raise StorageError(f"{target}: no bucket given (expected {kind}://bucket/key)")
    try:
        fs = _object_store(kind)
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow built without the store, bad env settings
        raise StorageError(f"{target}: cannot set up the {kind}:// filesystem: {exc}") from exc
    return Location(f"{kind}://{path}", path, fs)
