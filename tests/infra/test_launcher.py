"""Offline validation of the deployment files in infra/ (no network, no Docker, no cluster).

- Ray cluster launcher YAMLs (infra/ray/*.yaml): the JSON schema shipped inside the installed ``ray``
  package, then Ray's own offline ``prepare_config`` / ``validate_config`` (what ``ray up`` runs
  before it talks to a cloud), then the shape this project needs: a CPU head, autoscaling 1-GPU and
  8-GPU worker types, the project's image, token authentication on every ``ray start``.
- KubeRay manifests (infra/k8s/*.yaml): the RayJob/RayCluster ``openAPIV3Schema`` of KubeRay v1.6.0
  (vendored in kuberay_rayjob_schema.json, unknown fields rejected as ``kubectl apply`` does), then
  the project's contract: token auth, GPU limits on workers, the project image everywhere, the
  model-cache PVC mounted where ``CRITICALKV_CACHE_DIR`` points, a ServiceAccount that exists, and a
  RayJob entrypoint that runs a real job script from jobs/ with flags that script's argparse
  parser accepts, with object-storage URIs as ``--input`` / ``--output``.
- infra/docker/Dockerfile: the same pyproject extras and the same ``--no-deps`` packages as the
  Makefile, CUDA torch first, a non-root user, the venv's python first on PATH; .dockerignore keeps
  the sources and drops .venv/.git/outputs.

Every check is a function returning a list of problems. The tests run them on the real files and
then, in ``test_checks_reject_broken_*``, on broken copies, so each check is shown to fail on a
broken manifest.
"""

from __future__ import annotations

import re

import pytest

from tests.infra.infra_common import LAUNCHER_FILES, _load_yaml, _mutated
from tests.infra.launcher_checks import (
    launcher_prepare_problems,
    launcher_problems,
    launcher_schema_problems,
)


def test_launcher_files_exist_for_aws_and_gcp():
    names = [p.name for p in LAUNCHER_FILES]
    assert any("aws" in n for n in names) and any("gcp" in n for n in names), names


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_launcher_yaml_validates_against_ray_schema(path):
    assert launcher_schema_problems(_load_yaml(path)) == []


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_launcher_yaml_passes_ray_up_offline_checks(path):
    assert launcher_prepare_problems(_load_yaml(path)) == []


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_launcher_yaml_cluster_shape_auth_and_mounts(path):
    assert launcher_problems(path.name, _load_yaml(path)) == []


LAUNCHER_BREAKAGES = [
    "unknown top-level key",
    "string resources",
    "head type not defined",
    "min_workers above max_workers",
    "no 8-GPU worker type",
    "GPU head",
    "foreign image",
    "head without token auth",
    "token file not mounted",
    "cache dir never created",
]


def launcher_breakage(name: str, cfg: dict) -> tuple[dict, str]:
    """A broken copy of a launcher config and the text the problems must mention."""
    head = cfg["head_node_type"]
    gpu8 = next(n for n, t in cfg["available_node_types"].items() if t.get("resources", {}).get("GPU") == 8)
    if name == "unknown top-level key":
        return _mutated(cfg, ["max_worker"], 3), "max_worker"
    if name == "string resources":
        return _mutated(cfg, ["available_node_types", gpu8, "resources", "GPU"], "8"), "GPU"
    if name == "head type not defined":
        return _mutated(cfg, ["head_node_type"], "nope"), "head_node_type"
    if name == "min_workers above max_workers":
        return _mutated(cfg, ["available_node_types", gpu8, "min_workers"], cfg["max_workers"] + 1), "max_workers"
    if name == "no 8-GPU worker type":
        return _mutated(cfg, ["available_node_types", gpu8], delete=True), "8 GPU"
    if name == "GPU head":
        return _mutated(
            cfg, ["available_node_types", head, "resources"], {"CPU": 4, "GPU": 1}
        ), "head node type has GPUs"
    if name == "foreign image":
        return _mutated(cfg, ["docker", "image"], "rayproject/ray:2.60.0-gpu"), "project's image"
    if name == "head without token auth":
        cmds = [c.replace("RAY_AUTH_MODE=token", "") for c in cfg["head_start_ray_commands"]]
        return _mutated(cfg, ["head_start_ray_commands"], cmds), "RAY_AUTH_MODE=token"
    if name == "token file not mounted":
        cmds = [
            re.sub(r"RAY_AUTH_TOKEN_PATH=\S+", "RAY_AUTH_TOKEN_PATH=/tmp/tok", c)
            for c in cfg["worker_start_ray_commands"]
        ]
        return _mutated(cfg, ["worker_start_ray_commands"], cmds), "not under any file_mounts"
    if name == "cache dir never created":
        return _mutated(cfg, ["initialization_commands"], []), "never create"
    raise KeyError(name)


@pytest.mark.parametrize("name", LAUNCHER_BREAKAGES)
@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_checks_reject_broken_launcher_yaml(path, name):
    config, expect = launcher_breakage(name, _load_yaml(path))
    problems = launcher_problems(path.name, config)
    assert any(expect in p for p in problems), (name, problems)
