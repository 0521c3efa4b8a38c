"""Test-only dependencies come from the dev extra (``pip install -e '.[dev]'``, which ``make test``
runs). A missing one fails with that sentence instead of skipping the tests that need it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require_dev(module: str) -> ModuleType:
    """Import ``module`` or raise naming the dev extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module} is missing: the tests need the dev extra (pip install -e '.[dev]'; make test installs it)"
        ) from exc
