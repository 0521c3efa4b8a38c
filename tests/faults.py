"""Fault behaviours for the reliability tests, plugged into the pipeline's one test hook
(:mod:`pipeline.hooks`). Production code knows nothing of these.

Directives (a JSON object):

* ``oom``: doc ids whose batch prefill raises ``torch.OutOfMemoryError`` (the CUDA allocator's
  error type), with ``oom_above``: only while the cache size in use is above it;
* ``crash``: doc ids whose batch prefill ends the process abruptly (``os._exit``), a killed actor;
  with ``crash_marker`` (a path) only while the marker does not exist, creating it first, so the
  retried batch succeeds;
* ``raise_after_batches`` N (+ ``raise_delay_s``): an actor raises when asked for batch N+1;
* ``error_doc_ids``: generation raises for batches holding these documents.
* ``wait_for_commit``: ``{"before": doc id, "dir": output data directory, "timeout_s": s, "marker": path}``:
  the prefill of that document first waits (at most ``timeout_s``) until the driver has committed a
  file in ``dir``, and writes to ``marker`` whether it saw one (``committed``) or gave up (``timeout``).

In-process: ``pipeline.hooks.install(Faults({...}))``. In Ray actors: the tests' engine factory
(``tests/distributed/helpers.py``) calls :func:`install_from_environment`, which installs :func:`hook`
when ``$CRITICALKV_TEST_FAULTS_FILE`` names a file (:func:`environment` gives that variable for a
run's processes); :func:`hook` reads the directives from it at every event, so a test may change
them between runs. Production code imports nothing of this.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from pipeline import hooks

FILE_ENV = "CRITICALKV_TEST_FAULTS_FILE"
KNOWN = {
    "oom",
    "oom_above",
    "crash",
    "crash_marker",
    "raise_after_batches",
    "raise_delay_s",
    "error_doc_ids",
    "wait_for_commit",
}


class InjectedFault(RuntimeError):
    """Raised on purpose by a directive."""


class Faults:
    """A hook applying ``directives`` (see the module docstring)."""

    def __init__(self, directives: dict) -> None:
        unknown = set(directives) - KNOWN
        if unknown:
            raise ValueError(f"unknown fault directive(s) {sorted(unknown)}; use {sorted(KNOWN)}")
        self.d = directives

    def __call__(self, event: str, **context) -> None:
        doc_ids = set(context.get("doc_ids", ()))
        if event == "engine.prefill":
            self._crash(doc_ids)
            self._wait_for_commit(doc_ids)
            hit = set(self.d.get("oom", ())) & doc_ids
            if hit and context.get("cache_size", 1.0) > self.d.get("oom_above", -1.0):
                raise torch.OutOfMemoryError(
                    f"simulated out of memory while prefilling {sorted(hit)} (fault injection)"
                )
        elif event == "predictor.batch":
            limit = self.d.get("raise_after_batches")
            if limit is not None and context["batch"] > limit:
                time.sleep(self.d.get("raise_delay_s", 0.0))
                raise InjectedFault(f"fault injection: raise_after_batches={limit} reached")
        elif event == "predictor.generate":
            bad = sorted(set(self.d.get("error_doc_ids", ())) & doc_ids)
            if bad:
                raise InjectedFault(f"fault injection: generation failed for document {bad[0]!r}")

    def _wait_for_commit(self, doc_ids: set[str]) -> None:
        wait = self.d.get("wait_for_commit")
        if not wait or wait["before"] not in doc_ids:
            return
        deadline = time.monotonic() + wait["timeout_s"]
        seen = False
        while not seen and time.monotonic() < deadline:
            seen = any(Path(wait["dir"]).glob("part-*.parquet"))
            time.sleep(0.05)
        Path(wait["marker"]).write_text("committed" if seen else "timeout")

    def _crash(self, doc_ids: set[str]) -> None:
        if not set(self.d.get("crash", ())) & doc_ids:
            return
        marker = self.d.get("crash_marker")
        if marker is not None and Path(marker).exists():
            return
        if marker is not None:
            Path(marker).touch()
        os._exit(1)


def hook(event: str, **context) -> None:
    """The environment-installed hook: directives from ``$CRITICALKV_TEST_FAULTS_FILE`` (none: no fault)."""
    path = os.environ.get(FILE_ENV)
    if not path or not Path(path).is_file():
        return
    Faults(json.loads(Path(path).read_text() or "{}"))(event, **context)


def environment(faults_file: str | Path) -> dict[str, str]:
    """Variables under which the tests' engine factory installs :func:`hook`, reading ``faults_file``."""
    return {FILE_ENV: str(faults_file)}


def install_from_environment() -> None:
    """Install :func:`hook` in this process when ``$CRITICALKV_TEST_FAULTS_FILE`` is set (an actor of a
    test run); called by the tests' engine factory, the only seam a Ray actor offers a test."""
    if os.environ.get(FILE_ENV):
        hooks.install(hook)


def write(faults_file: str | Path, **directives) -> None:
    """Set the directives every process reads from now on (``{}`` turns faults off)."""
    Faults(directives)  # validate
    Path(faults_file).write_text(json.dumps(directives))
