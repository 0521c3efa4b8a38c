"""The fault seam (pipeline.hooks): installed in-process only; in Ray actors by the tests' engine factory."""

import ast
import inspect

import pytest

from pipeline import hooks
from tests import faults
from tests.distributed.helpers import tiny_engine


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(hooks, "_installed", None)
    yield


def test_no_hook_does_nothing_and_unknown_events_are_refused():
    hooks.fire("predictor.batch", batch=1, doc_ids=[])
    with pytest.raises(ValueError, match="unknown hook event 'engine.decode'"):
        hooks.fire("engine.decode")


def test_an_installed_hook_sees_every_event():
    seen = []
    hooks.install(lambda event, **context: seen.append((event, context)))
    hooks.fire("predictor.generate", doc_ids=["a"])
    assert seen == [("predictor.generate", {"doc_ids": ["a"]})]


def test_production_reads_no_environment_and_imports_nothing_by_name():
    tree = ast.parse(inspect.getsource(hooks))
    imported = {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names
    }
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"annotations", "Callable"} and modules == {"__future__", "collections.abc"}


def test_the_tests_engine_factory_installs_the_faults_named_in_the_environment(monkeypatch, tmp_path):
    from pipeline.engine.config import GenerationConfig, ModelConfig
    from pipeline.kv.config import CompressionConfig

    build = (ModelConfig(name="tiny-llama"), CompressionConfig(), GenerationConfig())
    monkeypatch.delenv(faults.FILE_ENV, raising=False)
    tiny_engine(*build)
    hooks.fire("predictor.batch", batch=1, doc_ids=[])  # no faults file: nothing installed
    faults.write(tmp_path / "faults.json", raise_after_batches=0)
    for name, value in faults.environment(tmp_path / "faults.json").items():
        monkeypatch.setenv(name, value)
    tiny_engine(*build)
    with pytest.raises(faults.InjectedFault, match="raise_after_batches=0"):
        hooks.fire("predictor.batch", batch=1, doc_ids=[])
