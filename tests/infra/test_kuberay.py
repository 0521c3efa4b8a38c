"""See tests/infra/test_launcher.py for what the infra tests check and how."""

from __future__ import annotations

import copy
import re
import shlex

import pytest

from tests.infra.infra_common import (
    TOKEN_AUTH_SECRET_KEY,
    _dig,
    _load_k8s_docs,
    _mutated,
)
from tests.infra.kuberay_checks import (
    _rayjob_entrypoints,
    _readme_job_commands,
    _require_job_scripts,
    entrypoint_problems,
    entrypoint_script,
    k8s_problems,
    parse_job_args,
)


def test_kuberay_manifests_are_valid():
    assert k8s_problems(_load_k8s_docs()) == []


def test_rayjob_entrypoint_runs_a_job_script_with_accepted_flags():
    entrypoints = _rayjob_entrypoints(_load_k8s_docs())
    assert entrypoints, "no RayJob in infra/k8s"
    _require_job_scripts(entrypoints)
    for entrypoint in entrypoints:
        assert entrypoint_problems(entrypoint) == []


def test_readme_job_commands_use_accepted_flags():
    commands = _readme_job_commands()
    assert commands, "infra/README.md shows no `python jobs/....py` command"
    _require_job_scripts(commands)
    for command in commands:
        argv = shlex.split(command)
        script, args, problems = entrypoint_script(argv)
        assert problems == [] and script is not None, (command, problems)
        namespace, message = parse_job_args(script, args)
        assert namespace is not None, f"{command}: {message}"


def test_rayjob_object_storage_uris_reach_the_job_config():
    from pipeline.apps import batch_jobs as cli

    for entrypoint in _rayjob_entrypoints(_load_k8s_docs()):
        argv = shlex.split(entrypoint)
        script, args, _ = entrypoint_script(argv)
        try:
            config = cli.config_from_args(script.stem, args)
        except SystemExit as exc:
            raise AssertionError(f"config_from_args rejected the entrypoint (exit {exc.code})") from None
        assert str(config.input) == args[args.index("--input") + 1]
        assert str(config.output) == args[args.index("--output") + 1]


K8S_BREAKAGES = [
    "wrong apiVersion",
    "misspelt field",
    "missing required field",
    "auth disabled",
    "no GPU limit on a worker",
    "GPU request != limit",
    "container without image",
    "integer rayStartParams",
    "PVC renamed",
    "cache dir off the PVC",
    "unknown service account",
    "old rayVersion",
    "committed secret",
]


def k8s_breakage(name: str, docs: list[dict]) -> tuple[list[dict], str]:
    """A broken copy of the manifests and the text the problems must mention."""
    ci = next(i for i, d in enumerate(docs) if d.get("kind") == "RayCluster")
    ji = next(i for i, d in enumerate(docs) if d.get("kind") == "RayJob")
    pvc = next(i for i, d in enumerate(docs) if d.get("kind") == "PersistentVolumeClaim")
    workers = ["spec", "workerGroupSpecs"]
    pod0 = workers + [0, "template", "spec"]
    c0 = pod0 + ["containers", 0]
    env0 = next(i for i, e in enumerate(_dig(docs[ci], c0 + ["env"])) if e.get("name") == "CRITICALKV_CACHE_DIR")

    def at(index, path, value=None, delete=False):
        out = copy.deepcopy(docs)
        out[index] = _mutated(out[index], path, value, delete)
        return out

    cases = {
        "wrong apiVersion": lambda: (at(ci, ["apiVersion"], "ray.io/v1alpha1"), "apiVersion"),
        "misspelt field": lambda: (at(ji, ["spec", "shutdownAfterJobFinish"], True), "shutdownAfterJobFinish"),
        "missing required field": lambda: (at(ci, workers + [0, "groupName"], delete=True), "groupName"),
        "auth disabled": lambda: (at(ci, ["spec", "authOptions", "mode"], "disabled"), "authOptions.mode"),
        "no GPU limit on a worker": lambda: (
            at(ci, c0 + ["resources", "limits"], {"cpu": "7", "memory": "28Gi"}),
            "nvidia.com/gpu",
        ),
        "GPU request != limit": lambda: (at(ci, c0 + ["resources", "requests", "nvidia.com/gpu"], "2"), "request"),
        "container without image": lambda: (at(ci, c0 + ["image"], delete=True), "no image"),
        "integer rayStartParams": lambda: (
            at(ci, ["spec", "headGroupSpec", "rayStartParams", "num-cpus"], 0),
            "rayStartParams",
        ),
        "PVC renamed": lambda: (at(pvc, ["metadata", "name"], "other-cache"), "no PVC manifest"),
        "cache dir off the PVC": lambda: (at(ci, c0 + ["env", env0, "value"], "/tmp/cache"), "CRITICALKV_CACHE_DIR"),
        "unknown service account": lambda: (at(ci, pod0 + ["serviceAccountName"], "nobody"), "ServiceAccount"),
        "old rayVersion": lambda: (at(ci, ["spec", "rayVersion"], "2.40.0"), "rayVersion"),
        "committed secret": lambda: (
            docs
            + [
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": "criticalkv-ray-auth"},
                    "stringData": {TOKEN_AUTH_SECRET_KEY: "x"},
                }
            ],
            "must not be committed",
        ),
    }
    return cases[name]()


@pytest.mark.parametrize("name", K8S_BREAKAGES)
def test_checks_reject_broken_kuberay_manifests(name):
    docs, expect = k8s_breakage(name, _load_k8s_docs())
    problems = k8s_problems(docs)
    assert any(expect in p for p in problems), (name, problems)


def test_checks_reject_broken_rayjob_entrypoints():
    entrypoint = _rayjob_entrypoints(_load_k8s_docs())[0]
    script, _, _ = entrypoint_script(shlex.split(entrypoint))
    assert any("does not exist" in p for p in entrypoint_problems(entrypoint.replace(script.name, "no_such_job.py")))
    assert any(
        "is not jobs/<name>.py" in p for p in entrypoint_problems("python /app/pipeline/generate.py --input s3://b/x")
    )
    _require_job_scripts([entrypoint])
    assert any("rejects" in p for p in entrypoint_problems(entrypoint + " --no-such-flag 1"))
    assert any("rejects" in p for p in entrypoint_problems(entrypoint + " --cache-size lots"))
    local = re.sub(r"--output \S+", "--output /tmp/out", entrypoint)
    assert any("object storage URI" in p for p in entrypoint_problems(local))


def test_a_mistyped_job_script_fails_instead_of_skipping():
    with pytest.raises(pytest.fail.Exception, match="jobs/longdoc_qaa.py.*does not exist"):
        _require_job_scripts(["python jobs/longdoc_qaa.py --output s3://b/o"])
