"""``OUT/manifest.json``, typed: the output's identity and one :class:`RunRecord` per run.

The file holds a JSON object: ``schema_version``, ``job``, ``output``, ``data``, ``identity``,
``fingerprint``, ``created_at``, ``updated_at``, ``runs`` (a list of run records, oldest first) and,
after a run that checked its rows, ``totals``. Earlier runs' records are kept as they were read;
the current run's is a :class:`RunRecord`, written into the list on each write of the manifest.
Every record has the same keys; those a run has not reached yet are ``null``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ABANDONED = (
    "its driver ended without recording the run's end: killed, or the manifest could not be written "
    "(e.g. full storage; that run's last error line said which)"
)


@dataclass
class RowCounts:
    """What a run found and did, in rows and documents (None: not known, e.g. inputs normalised in Ray)."""

    committed_before: int  # rows committed by earlier runs
    docs_input: int | None
    docs_skipped: int | None  # every question already answered
    docs_scheduled: int | None
    docs_changed: int | None  # committed rows computed from other content (kept, warned)
    written: int | None = None  # committed by this run, after duplicates were removed
    ok: int | None = None
    failed: int | None = None
    duplicates_removed: int | None = None
    missing: int | None = None  # expected (doc_id, question_id) keys without a row
    committed_total: int | None = None


@dataclass
class RunRecord:
    """One run into the output: ``running`` from its start, then ``completed``, ``failed`` or
    ``interrupted`` (a later run marks one left ``running`` as interrupted, :func:`close_abandoned_runs`)."""

    run_id: str
    started_at: str
    config: dict[str, Any]  # the job's settings, as JSON
    normalise: str  # where inputs were normalised: "driver" or "ray"
    host: dict[str, Any]
    versions: dict[str, str]
    temporary_files_removed: int  # debris of killed writes deleted when the run opened the output
    rows: RowCounts
    status: str = "running"
    ended_at: str | None = None
    gpu: dict[str, Any] = field(default_factory=dict)  # "cluster" GPUs, "actor_devices" used
    wall_s: float | None = None
    ray: dict[str, Any] | None = None  # address, resources, actors
    error: str | None = None  # one sentence, when the run did not complete
    summary: dict[str, Any] | None = None  # :meth:`pipeline.distributed.summary.RunSummary.as_dict`
    model_source: dict[str, Any] = field(default_factory=dict)  # kind, id/uri, revision and resolved commit
    calibration: dict[str, Any] | None = None  # the learned scorer calibrated for this job (path, documents, fit)
    worker_deaths: list[dict[str, Any]] = field(default_factory=list)  # documents that killed their worker (id, error)

    def end(self, status: str, ended_at: str, error: str | None) -> None:
        self.status, self.ended_at, self.error = status, ended_at, error

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def new_manifest(
    schema_version: int, job: str, output: str, data: str, identity: dict, fingerprint: str, created_at: str
) -> dict[str, Any]:
    """The manifest of an output no run has written yet."""
    return {
        "schema_version": schema_version,
        "job": job,
        "output": output,
        "data": data,
        "identity": identity,
        "fingerprint": fingerprint,
        "created_at": created_at,
        "runs": [],
    }


def close_abandoned_runs(manifest: dict[str, Any], now: str) -> None:
    """Runs a manifest still calls ``running`` when a new run opens it: their driver died, or could not
    write the manifest at the end (a full disk). They become ``interrupted``, with an ``error`` saying so
    where the run recorded none."""
    for old in manifest["runs"]:
        if old.get("status") == "running":
            old["status"] = "interrupted"
            old["error"] = old.get("error") or ABANDONED
            old["ended_at"] = old.get("ended_at") or now
