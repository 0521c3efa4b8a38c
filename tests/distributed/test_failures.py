"""One sentence per failure: the root cause through Ray's wrappers, and storage hints."""

from __future__ import annotations

import errno

from pipeline.distributed.failures import describe, root_cause, storage_hint


class SilentWrapper(Exception):
    """Like Ray Data's SystemException: a wrapper without a message."""


def test_root_cause_skips_wrappers_without_a_message():
    try:
        try:
            raise ValueError("the real reason")
        except ValueError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as outer:
        assert describe(outer) == "ValueError: the real reason"
    died = RuntimeError("The actor died because of an error raised in its creation task, ...")
    died.__cause__ = SilentWrapper()
    assert root_cause(died) is died


def test_an_actor_that_failed_to_start_is_described_by_its_constructor_error():
    text = (
        "The actor died because of an error raised in its creation task, ray::MapWorker.__init__()\n"
        'Traceback (most recent call last):\n  File "predictor.py", line 86, in check_same_code\n'
        "    raise RuntimeError(\nRuntimeError: this Ray worker imported other code"
    )
    assert describe(RuntimeError(text)) == "RuntimeError while starting an actor: this Ray worker imported other code"
    assert describe(RuntimeError("no traceback\nsecond line")) == "RuntimeError: no traceback"


def test_storage_hint_names_full_storage():
    assert "full" in storage_hint(OSError(errno.ENOSPC, "No space left on device"))
    assert storage_hint(ValueError("other")) is None


def test_a_run_left_running_is_closed_with_an_error_by_the_next_run():
    """A full disk can keep the manifest from recording a run's failure; the run that opens the
    manifest next records that the earlier one ended without saying how, instead of nothing."""
    from pipeline.distributed.manifest import ABANDONED, close_abandoned_runs

    manifest = {
        "runs": [
            {"run_id": "a", "status": "failed", "error": "OSError: No space left on device", "ended_at": "t1"},
            {"run_id": "b", "status": "running", "error": None, "ended_at": None},
        ]
    }
    close_abandoned_runs(manifest, "2026-12-03T00:00:00Z")
    first, second = manifest["runs"]
    assert first == {"run_id": "a", "status": "failed", "error": "OSError: No space left on device", "ended_at": "t1"}
    assert second["status"] == "interrupted" and second["error"] == ABANDONED and second["ended_at"]
    assert "full storage" in ABANDONED
