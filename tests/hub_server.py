"""A local HTTP server that plays the Hugging Face Hub for tests (no network): the few endpoints
``huggingface_hub`` calls to download a model, with the Hub's error headers.

Serves repositories held in memory: ``GET /api/models/{id}[/revision/{rev}]`` (model info with its
files), ``GET /api/models/{id}/tree/{rev}`` (the file listing), ``HEAD`` / ``GET
/{id}/resolve/{rev}/{path}`` (a file, with ``X-Repo-Commit`` and ``ETag``). A gated repository answers
file requests without a token with 401 ``X-Error-Code: GatedRepo``; an unknown repository 404
``RepoNotFound``; an unknown revision 404 ``RevisionNotFound``. ``downloads`` counts the file bodies sent.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    commit: str = ""
    branches: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        digest = hashlib.sha1(b"".join(k.encode() + v for k, v in sorted(self.files.items())))
        self.commit = self.commit or digest.hexdigest()
        self.branches = self.branches or {"main": self.commit}

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision == self.commit else None


def repo_from_directory(directory: Path, gated: bool = False) -> Repo:
    """A repository holding every file of a saved model directory."""
    files = {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
    return Repo(files, gated=gated)


class HubServer:
    """``with HubServer(repos) as hub:`` serves ``repos`` ({repo id: Repo}) at ``hub.url``."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.downloads: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _split(path: str) -> tuple[str, list[str]]:
    parts = [unquote(p) for p in path.strip("/").split("/")]
    return "/".join(parts[:2]), parts[2:]


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _json(self, data) -> None:
            body = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound")
            return repo

        def _api(self, rest: str) -> None:
            repo_id, tail = _split(rest)
            repo = self._repo(repo_id)
            if repo is None:
                return
            revision = tail[1] if len(tail) >= 2 and tail[0] in ("revision", "tree") else "main"
            commit = repo.resolve(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound")
            if tail[:1] == ["tree"]:
                files = repo.files.items()
                return self._json(
                    [{"type": "file", "oid": hashlib.sha1(v).hexdigest(), "size": len(v), "path": k} for k, v in files]
                )
            siblings = [{"rfilename": name} for name in repo.files]
            return self._json(
                {"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings, "private": False}
            )

        def _file(self, body: bool) -> None:
            repo_id, tail = _split(urlsplit(self.path).path)
            repo = self._repo(repo_id)
            if repo is None:
                return
            if len(tail) < 3 or tail[0] != "resolve":
                return self._error(404, "EntryNotFound")
            commit = repo.resolve(tail[1])
            if commit is None:
                return self._error(404, "RevisionNotFound")
            if repo.gated and not self.headers.get("Authorization"):
                return self._error(401, "GatedRepo")
            name = "/".join(tail[2:])
            if name not in repo.files:
                return self._error(404, "EntryNotFound")
            data = repo.files[name]
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                with hub.lock:
                    hub.downloads[f"{repo_id}/{name}"] += 1
                self.wfile.write(data)

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's names
            self._file(body=False)

        def do_GET(self) -> None:  # noqa: N802
            path = urlsplit(self.path).path
            if path.startswith("/api/models/"):
                return self._api(path[len("/api/models/") :])
            return self._file(body=True)

    return Handler
