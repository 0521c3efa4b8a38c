"""Turning a failure inside a run into one sentence: the root cause (Ray wraps exceptions raised in
its workers), and what to do about storage errors."""

from __future__ import annotations

import errno
import re

STORAGE_HINTS = {
    errno.ENOSPC: "the output storage is full: free space (or choose another --output)",
    errno.EDQUOT: "the output storage quota is exhausted: free space (or choose another --output)",
    errno.EACCES: "the output is not writable by this user: fix its permissions (or choose another --output)",
    errno.EPERM: "the output is not writable by this user: fix its permissions (or choose another --output)",
    errno.EROFS: "the output is on a read-only filesystem: choose another --output",
}


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception that says something: through Ray's task errors (``.cause``) and
    Python's ``__cause__``, skipping wrappers without a message (Ray Data's ``SystemException``)."""
    seen, said = set(), exc
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None)
        if not isinstance(inner, BaseException):
            inner = exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
        if str(exc).strip():
            said = exc
    return said


_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.+)$")


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` of the root cause (no traceback). An actor that failed
    to start (Ray's ``ActorDiedError`` carries the traceback of its constructor as text) is
    described by the exception its constructor raised."""
    root = root_cause(exc)
    lines = [line.strip() for line in str(root).strip().splitlines() if line.strip()]
    if not lines:
        return type(root).__name__
    if "error raised in its creation task" in lines[0]:
        for line in reversed(lines):
            raised = _RAISED.match(line)
            if raised:
                return f"{raised.group(1).rsplit('.', 1)[-1]} while starting an actor: {raised.group(2)[:500]}"
    return f"{type(root).__name__}: {lines[0][:500]}"


def storage_hint(exc: BaseException) -> str | None:
    """What to do when the root cause is an OSError of the storage (full, not writable, read-only)."""
    root = root_cause(exc)
    code = getattr(root, "errno", None)
    if code is None:  # pyarrow's filesystems raise OSError with the message only
        text = str(root).lower()
        code = errno.ENOSPC if "no space left" in text else errno.EACCES if "permission denied" in text else None
    return STORAGE_HINTS.get(code) if isinstance(root, OSError) else None
