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
