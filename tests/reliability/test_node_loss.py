"""A worker node leaves mid-job (``ray.cluster_utils.Cluster``: a head without CPUs + 2 workers);
the job finishes and every doc_id x question appears exactly once."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.data import write_documents
from pipeline.distributed import run_job
from pipeline.distributed.sink import committed_files
from tests.distributed.conftest import small_docs, tiny_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_worker_node_removed_mid_job(tmp_path):
    import ray  # a hard dependency: missing, the test must fail, not skip
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    try:
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}, log_to_driver=False)
        docs = small_docs(10, words=120, seed=13)
        path = write_documents(docs, tmp_path / "in.jsonl")
        config = tiny_config(
            tmp_path / "out",
            input=str(path),
            rows_per_file=1,
            min_actors=2,
            max_actors=2,
            cpus_per_actor=1,
            generation={"max_new_tokens": 48, "batch_size": 1},
        )
        result: dict = {}
        job = threading.Thread(target=lambda: result.setdefault("run", run_job(config, echo=False)))
        job.start()
        data = tmp_path / "out" / "data"
        deadline = time.time() + 240
        while time.time() < deadline and job.is_alive() and len(committed_files(data) if data.exists() else []) < 1:
            time.sleep(0.2)
        assert job.is_alive(), "the job finished before a node could be removed"
        cluster.remove_node(workers[0])  # takes one actor (and whatever batch it held) with it
        cluster.add_node(num_cpus=1)  # capacity comes back, as an autoscaler would bring it
        job.join(timeout=400)
        assert not job.is_alive() and "run" in result
        rows = [r for f in committed_files(data) for r in pq.read_table(f).to_pylist()]
        keys = Counter((r["doc_id"], r["question_id"]) for r in rows)
        assert set(keys) == {(d["doc_id"], q) for d in docs for q in d["question_ids"]}
        assert max(keys.values()) == 1
    finally:
        ray.shutdown()
        cluster.shutdown()
