"""Fixtures for the distributed tests: one local Ray per module, tiny in-code models."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from pipeline.data import sample_qa_documents
from pipeline.distributed.config import JOB_CONFIGS, JobConfig
from tests import faults as fault_hook

ROOT = Path(__file__).resolve().parents[2]
TINY_FACTORY = "tests.distributed.helpers:tiny_engine"
# job flags that run the tiny in-code Llama on one CPU per actor (add --max-new-tokens and the rest)
TINY_JOB_ARGS = ["--model", "tiny-llama", "--engine-factory", TINY_FACTORY, "--window", "4", "--kernel", "3"]
TINY_JOB_ARGS += ["--cpus-per-actor", "1", "--batch-size", "1"]  # one document per call: tests count per document
# a method with kvzap or shares needs a KVzap file made for the model: none exists for the
# random tiny models, so these runs name one that needs none (the default needs one: the jobs would
# calibrate first, see tests/distributed/test_self_calibration.py)
TINY_JOB_ARGS += ["--method", "criticalkv-layer-kvzip"]


@pytest.fixture(scope="module")
def local_ray():
    """``ray.init(address="local")`` with 2 CPUs and one logical GPU, its own temp dir, no dashboard.

    The logical GPU lets ``num_gpus=1`` actors schedule on a CPU machine (the GPU path); workers
    get the repository on PYTHONPATH so they can import the test-only engine factory, and the test
    hook (``tests/faults.py``) reading ``ray.faults_file``, empty unless the :func:`faults` fixture sets it.
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    faults_file = Path(temp_dir) / "faults.json"
    env = {"PYTHONPATH": str(ROOT), **fault_hook.environment(faults_file)}
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=1,
        include_dashboard=False,
        _temp_dir=temp_dir,
        runtime_env={"env_vars": env},
        log_to_driver=False,
    )
    ray.faults_file = faults_file
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def faults(local_ray):
    """``faults(**directives)`` turns faults on in every actor of the module's Ray; off again after the test."""
    yield lambda **directives: fault_hook.write(local_ray.faults_file, **directives)
    fault_hook.write(local_ray.faults_file)


def tiny_config(output, **overrides) -> JobConfig:
    """A job config (the job's own class, which offers the built-in samples) running the tiny Llama
    with CriticalKV at 50 % on one 1-CPU actor, one document per actor call (the commit, resume and
    fault tests count per document; the automatic batch size has its own tests)."""
    settings = dict(
        output=str(output),
        model={"name": "tiny-llama"},
        engine_factory=TINY_FACTORY,
        compression={"method": "criticalkv-snapkv", "cache_size": 0.5, "window": 4, "kernel": 3},
        generation={"max_new_tokens": 3, "batch_size": 1},
        cpus_per_actor=1,
        rows_per_file=2,
        sample_words=60,
    )
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key] = {**settings[key], **value}
        else:
            settings[key] = value
    return JOB_CONFIGS[settings.get("job", "longdoc_qa")](**settings)  # the job's own config: built-in samples


def small_docs(n: int = 6, words: int = 60, seed: int = 1) -> list[dict]:
    """Sample QA documents with short contexts and generation limits left to the config."""
    docs = sample_qa_documents(n, words, seed)
    for doc in docs:
        doc["max_new_tokens"] = None
    return docs
