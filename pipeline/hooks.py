"""The one test hook: where reliability tests inject faults into a running pipeline.

Production code calls :func:`fire` at a few named points; nothing happens unless a hook is
installed. A hook is any callable ``hook(event: str, **context)``; it may raise (a simulated
failure) or end the process (a simulated crash). It is installed

* in-process with :func:`install` (unit tests), or
* for every process of a run, Ray actors included, by naming it in the environment variable
  ``CRITICALKV_TEST_HOOK="tests.module:function"``; each process imports it at its first
  :func:`fire`. Only a function of the repository's ``tests`` package is accepted, so the variable
  cannot make a production process import anything else. Ray workers inherit the variable from the
  driver that starts a local Ray, or from a ``ray job submit --runtime-env-json`` ``env_vars`` entry.

Events and their context:

=====================  =====================================================================
``engine.prefill``     ``doc_ids`` (list[str]), ``cache_size`` (float, the prefill cache's kept
                       fraction): before a batch's context prefill, where an out-of-memory error
                       would happen
``predictor.batch``    ``batch`` (1-based count of this actor's batches), ``doc_ids``: when a Ray
                       actor receives a batch
``predictor.generate`` ``doc_ids``: before the actor asks its engine for answers
=====================  =====================================================================

The fault behaviours themselves live with the tests (``tests/faults.py``), not here.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

ENV_VAR = "CRITICALKV_TEST_HOOK"
EVENTS = ("engine.prefill", "predictor.batch", "predictor.generate")

_installed: Callable | None = None
_loaded_from_env = False


def install(hook: Callable | None) -> None:
    """Use ``hook`` in this process (None removes it)."""
    global _installed, _loaded_from_env
    _installed, _loaded_from_env = hook, True


def fire(event: str, **context) -> None:
    """Call the installed hook, if any (see the module docstring)."""
    if event not in EVENTS:
        raise ValueError(f"unknown hook event {event!r}")
    hook = _installed if _loaded_from_env else _load_from_env()
    if hook is not None:
        hook(event, **context)


def _load_from_env() -> Callable | None:
    global _installed, _loaded_from_env
    spec = os.environ.get(ENV_VAR, "").strip()
    _loaded_from_env = True
    if spec:
        module, _, name = spec.partition(":")
        if module.split(".")[0] != "tests" or not name:
            raise RuntimeError(f"${ENV_VAR}={spec!r}: expected tests.<module>:<function> (a test hook only)")
        try:
            _installed = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise RuntimeError(f"${ENV_VAR}={spec!r} cannot be imported: {exc}") from exc
    return _installed
