"""Fault injection for reliability tests (off unless ``CRITICALKV_ENGINE_FAULTS`` is set).

``CRITICALKV_ENGINE_FAULTS`` holds ``;``-separated directives, read once per engine:

* ``oom=ID1,ID2``   - prefilling a batch that contains one of these doc_ids raises
  ``torch.OutOfMemoryError`` (the CUDA allocator's error type), as a real OOM would;
* ``oom_above=F``   - with ``oom=``: raise only while the cache size in use is above F (a document
  that fits once compressed harder; exercises ``oom_retry_cache_size``);
* ``crash=ID``      - the process exits abruptly (``os._exit``) when it starts a batch containing
  this doc_id, simulating a killed actor; with ``crash_marker=PATH`` it crashes only while PATH does
  not exist and creates it first, so the retried batch succeeds.

Production runs never set the variable; the engine's behaviour is unchanged when it is absent.
(The jobs' own switch, ``CRITICALKV_FAULTS`` in :mod:`pipeline.job_config`, acts at the Ray
actor level; this one acts inside the engine, where out-of-memory errors happen.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

ENV_VAR = "CRITICALKV_ENGINE_FAULTS"


@dataclass(frozen=True)
class FaultInjection:
    oom_doc_ids: frozenset[str] = field(default_factory=frozenset)
    crash_doc_ids: frozenset[str] = field(default_factory=frozenset)
    crash_marker: Path | None = None
    oom_above: float = -1.0

    @classmethod
    def from_env(cls) -> "FaultInjection":
        return cls.parse(os.environ.get(ENV_VAR, ""))

    @classmethod
    def parse(cls, spec: str) -> "FaultInjection":
        """Parse a directive string (the format of ``CRITICALKV_ENGINE_FAULTS``)."""
        spec = spec.strip()
        values: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            key, _, value = part.partition("=")
            if key not in ("oom", "oom_above", "crash", "crash_marker"):
                raise ValueError(f"{ENV_VAR}: unknown directive {key!r} (use oom=, oom_above=, crash=, crash_marker=)")
            values[key] = value
        ids = lambda key: frozenset(filter(None, values.get(key, "").split(",")))  # noqa: E731
        marker = values.get("crash_marker")
        return cls(ids("oom"), ids("crash"), Path(marker) if marker else None, float(values.get("oom_above", -1.0)))

    @property
    def active(self) -> bool:
        return bool(self.oom_doc_ids or self.crash_doc_ids)

    def before_prefill(self, doc_ids: list[str], cache_size: float = 1.0) -> None:
        if self.crash_doc_ids.intersection(doc_ids):
            if self.crash_marker is None or not self.crash_marker.exists():
                if self.crash_marker is not None:
                    self.crash_marker.touch()
                os._exit(1)
        hit = self.oom_doc_ids.intersection(doc_ids)
        if hit and cache_size > self.oom_above:
            raise torch.OutOfMemoryError(f"simulated out of memory while prefilling {sorted(hit)} (fault injection)")
