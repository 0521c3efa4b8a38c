"""The one fault seam: named points where reliability tests inject faults into a running pipeline.

Production code calls :func:`fire` at a few named points; nothing happens unless a hook is
installed. A hook is any callable ``hook(event: str, **context)``; it may raise (a simulated
failure) or end the process (a simulated crash). Only code running in the process installs one,
with :func:`install`: a unit test directly, or, in every Ray actor of a run, the test's engine
factory (the job's ``engine_factory``, the documented extension point for custom engines), which the
actor calls before anything else. Nothing here reads the environment or imports code by name.

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

from collections.abc import Callable

EVENTS = ("engine.prefill", "predictor.batch", "predictor.generate")

_installed: Callable | None = None


def install(hook: Callable | None) -> None:
    """Use ``hook`` in this process (None removes it)."""
    global _installed
    _installed = hook


def fire(event: str, **context) -> None:
    """Call the installed hook, if any (see the module docstring)."""
    if event not in EVENTS:
        raise ValueError(f"unknown hook event {event!r}")
    if _installed is not None:
        _installed(event, **context)
