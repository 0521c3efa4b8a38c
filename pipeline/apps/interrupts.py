"""Ctrl-C and SIGTERM for the apps that run jobs: both end a run the same way (the manifest says
``interrupted``, a local Ray the job started is shut down, committed rows stay) with one line on
stderr and exit code 130 (Ctrl-C) or 143 (SIGTERM)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
EXIT_CTRL_C, EXIT_SIGTERM = 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


def _raise_terminated(signum, frame):
    raise Terminated


def run_interruptibly(work: Callable[[], T]) -> T | int:
    """``work()``, or the exit code of an interrupt (after its one line on stderr)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return work()
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, Terminated)
        print(
            f"interrupted ({'SIGTERM' if terminated else 'Ctrl-C'}): committed rows are kept; "
            "rerun the same command to resume",
            file=sys.stderr,
        )
        return EXIT_SIGTERM if terminated else EXIT_CTRL_C
    finally:
        signal.signal(signal.SIGTERM, previous)
