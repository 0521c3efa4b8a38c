"""The test hook (pipeline.hooks): installed in-process, or named in the environment, where only a
function of the tests package is accepted."""

import pytest

from pipeline import hooks


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(hooks, "_installed", None)
    monkeypatch.setattr(hooks, "_loaded_from_env", False)
    yield


def test_no_hook_does_nothing_and_unknown_events_are_refused(monkeypatch):
    monkeypatch.delenv(hooks.ENV_VAR, raising=False)
    hooks.fire("predictor.batch", batch=1, doc_ids=[])
    with pytest.raises(ValueError, match="unknown hook event 'engine.decode'"):
        hooks.fire("engine.decode")


def test_an_installed_hook_sees_every_event():
    seen = []
    hooks.install(lambda event, **context: seen.append((event, context)))
    hooks.fire("predictor.generate", doc_ids=["a"])
    assert seen == [("predictor.generate", {"doc_ids": ["a"]})]


@pytest.mark.parametrize("spec", ["os:system", "pipeline.hooks:install", "tests", "tests.faults"])
def test_the_environment_names_only_a_tests_function(monkeypatch, spec):
    monkeypatch.setenv(hooks.ENV_VAR, spec)
    with pytest.raises(RuntimeError, match="expected tests.<module>:<function>"):
        hooks.fire("predictor.batch", batch=1, doc_ids=[])


def test_the_environment_loads_a_tests_hook(monkeypatch, tmp_path):
    from tests import faults

    faults.write(tmp_path / "faults.json", raise_after_batches=0)
    for name, value in faults.environment(tmp_path / "faults.json").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(faults.InjectedFault, match="raise_after_batches=0"):
        hooks.fire("predictor.batch", batch=1, doc_ids=[])
    monkeypatch.setenv(hooks.ENV_VAR, "tests.faults:missing")
    monkeypatch.setattr(hooks, "_loaded_from_env", False)
    with pytest.raises(RuntimeError, match="cannot be imported"):
        hooks.fire("predictor.batch", batch=1, doc_ids=[])
