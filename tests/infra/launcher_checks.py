"""Checks of the Ray cluster launcher YAMLs (infra/ray/*.yaml); each returns a list of problems."""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import yaml

from tests.infra.infra_common import _image_problems, jsonschema


@functools.lru_cache(maxsize=1)
def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def launcher_schema_problems(config: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(ray_schema())
    return [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in validator.iter_errors(config)]


def launcher_prepare_problems(config: dict) -> list[str]:
    """Ray's own offline steps of ``ray up``: fill defaults, merge commands, validate."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        validate_config(prepare_config(copy.deepcopy(config)))
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return [f"ray's prepare_config/validate_config: {type(exc).__name__}: {exc}"]
    return []


def _start_commands(config: dict, key: str) -> str:
    return " ; ".join(config.get(key) or [])


def launcher_shape_problems(config: dict, provider: str) -> list[str]:
    problems = []
    if config.get("provider", {}).get("type") != provider:
        problems.append(f"provider.type is {config.get('provider', {}).get('type')!r}, expected {provider!r}")
    problems += _image_problems("docker.image", config.get("docker", {}).get("image"))
    types = config.get("available_node_types") or {}
    head = types.get(config.get("head_node_type"), {})
    if head.get("resources", {}).get("GPU", 0):
        problems.append("the head node type has GPUs; the head should be a CPU node")
    workers = {name: t for name, t in types.items() if name != config.get("head_node_type")}
    gpus = sorted(t.get("resources", {}).get("GPU", 0) for t in workers.values())
    for want in (1, 8):
        if want not in gpus:
            problems.append(f"no worker type with {want} GPU(s) (worker GPU counts: {gpus})")
    for name, t in workers.items():
        if t.get("min_workers", 0) != 0 or not t.get("max_workers"):
            problems.append(f"worker type {name}: expected autoscaling from 0 (min_workers 0, max_workers > 0)")
    head_start = _start_commands(config, "head_start_ray_commands")
    if "ray start --head" not in head_start or "--autoscaling-config=~/ray_bootstrap_config.yaml" not in head_start:
        problems.append(
            "head_start_ray_commands must run `ray start --head ... --autoscaling-config=~/ray_bootstrap_config.yaml`"
        )
    if "--address=$RAY_HEAD_IP:6379" not in _start_commands(config, "worker_start_ray_commands"):
        problems.append("worker_start_ray_commands must join $RAY_HEAD_IP:6379")
    return problems


def launcher_auth_problems(config: dict) -> list[str]:
    """Token auth: both ``ray start`` commands run with RAY_AUTH_MODE=token and a token file that
    file_mounts brings to every node; nothing turns auth off."""
    problems = []
    mounts = config.get("file_mounts") or {}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        cmd = _start_commands(config, key)
        if "RAY_AUTH_MODE=token" not in cmd:
            problems.append(f"{key}: `ray start` without RAY_AUTH_MODE=token")
        match = re.search(r"RAY_AUTH_TOKEN_PATH=(\S+)", cmd)
        if not match:
            problems.append(f"{key}: no RAY_AUTH_TOKEN_PATH for `ray start`")
            continue
        token_path = match.group(1)
        if not any(token_path == remote or token_path.startswith(remote.rstrip("/") + "/") for remote in mounts):
            problems.append(f"{key}: token file {token_path} is not under any file_mounts target {sorted(mounts)}")
    if "RAY_AUTH_MODE=disabled" in yaml.safe_dump(config):
        problems.append("RAY_AUTH_MODE=disabled appears in the config")
    return problems


def _docker_volumes(config: dict) -> list[tuple[str, str]]:
    vols = []
    for opt in config.get("docker", {}).get("run_options", []):
        m = re.match(r"^(?:-v|--volume)[ =](\S+?):(\S+)$", opt.strip())
        if m:
            vols.append((m.group(1), m.group(2)))
    return vols


def launcher_host_dir_problems(config: dict) -> list[str]:
    """Host directories bind-mounted into the container must be created (with the container user's
    ownership) by the initialization commands every node type actually runs (a node type's own
    list replaces the global one)."""
    problems = []
    for host, _ in _docker_volumes(config):
        for name, node_type in (config.get("available_node_types") or {}).items():
            cmds = node_type.get("initialization_commands", config.get("initialization_commands") or [])
            if not any(f"mkdir -p {host}" in c for c in cmds):
                problems.append(
                    f"node type {name}: initialization_commands never create {host} "
                    "(bind-mounted by docker.run_options)"
                )
    return problems


def launcher_problems(path_name: str, config: dict) -> list[str]:
    provider = "aws" if "aws" in path_name else "gcp" if "gcp" in path_name else "?"
    schema = launcher_schema_problems(config)
    if schema:  # later checks assume a schema-valid config
        return schema
    return (
        launcher_prepare_problems(config)
        + launcher_shape_problems(config, provider)
        + launcher_auth_problems(config)
        + launcher_host_dir_problems(config)
    )
