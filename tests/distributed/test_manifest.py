"""The manifest's run record (pipeline/distributed/manifest.py): one typed record per run, the same
keys in every state, written as JSON."""

from __future__ import annotations

import json

from pipeline.distributed.manifest import RowCounts, RunRecord

KEYS = [
    "run_id", "started_at", "config", "normalise", "host", "versions", "temporary_files_removed", "rows",
    "status", "ended_at", "gpu", "wall_s", "ray", "error", "summary", "model_source", "calibration", "worker_deaths",
]  # fmt: skip


def _record() -> RunRecord:
    rows = RowCounts(committed_before=3, docs_input=5, docs_skipped=1, docs_scheduled=4, docs_changed=0)
    return RunRecord("r1", "t0", {"job": "longdoc_qa"}, "driver", {"hostname": "h"}, {"ray": "2"}, 0, rows)


def test_a_running_record_has_every_key_with_the_unreached_ones_null():
    running = json.loads(json.dumps(_record().as_json()))
    assert list(running) == KEYS
    assert running["status"] == "running" and running["ended_at"] is None and running["error"] is None
    assert running["rows"]["committed_before"] == 3 and running["rows"]["written"] is None


def test_an_ended_record_keeps_the_same_keys():
    run = _record()
    run.rows.written, run.wall_s, run.summary = 7, 1.5, {"rows_ok": 7}
    run.end("failed", "t1", "OSError: No space left on device")
    ended = json.loads(json.dumps(run.as_json()))
    assert list(ended) == KEYS
    assert (ended["status"], ended["ended_at"], ended["error"]) == ("failed", "t1", "OSError: No space left on device")
    assert ended["rows"]["written"] == 7 and ended["summary"] == {"rows_ok": 7}
