"""Checks of the KubeRay manifests (infra/k8s/*.yaml) and their RayJob entrypoints; each returns a list of problems."""

from __future__ import annotations

import argparse
import copy
import functools
import io
import json
import re
import runpy
import shlex
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest
from packaging.version import Version

from tests.infra.docker_checks import dockerfile_instructions
from tests.infra.infra_common import (
    DOCKERFILE,
    INFRA,
    KUBERAY_SCHEMA_FILE,
    MIN_RAY_FOR_TOKEN_AUTH,
    OBJECT_STORE_SCHEMES,
    REPO,
    _image_problems,
    jsonschema,
)


@functools.lru_cache(maxsize=1)
def kuberay_schemas() -> dict[str, dict]:
    """Strict (unknown fields rejected) schemas for RayJob and RayCluster documents."""
    doc = json.loads(KUBERAY_SCHEMA_FILE.read_text())
    rayjob = copy.deepcopy(doc["schema"])

    def strict(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)
        return node

    rayjob["properties"]["metadata"] = {"type": "object", "required": ["name"]}
    raycluster = {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object", "required": ["name"]},
            "spec": copy.deepcopy(rayjob["properties"]["spec"]["properties"]["rayClusterSpec"]),
            "status": {"type": "object"},
        },
    }
    rayjob.setdefault("required", [])
    rayjob["required"] = sorted(set(rayjob["required"]) | {"apiVersion", "kind", "metadata", "spec"})
    return {"RayJob": strict(rayjob), "RayCluster": strict(raycluster)}


def kuberay_schema_problems(doc: dict) -> list[str]:
    schema = kuberay_schemas().get(doc.get("kind"))
    if schema is None:
        return []
    validator = jsonschema.Draft7Validator(schema)
    return [f"{doc['kind']} {'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]


K8S_API_VERSIONS = {
    "RayCluster": "ray.io/v1",
    "RayJob": "ray.io/v1",
    "PersistentVolumeClaim": "v1",
    "ServiceAccount": "v1",
    "Secret": "v1",
    "ConfigMap": "v1",
}


DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def k8s_header_problems(docs: list[dict]) -> list[str]:
    problems = []
    for doc in docs:
        kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name")
        if kind not in K8S_API_VERSIONS:
            problems.append(f"unexpected kind {kind!r}")
        elif doc.get("apiVersion") != K8S_API_VERSIONS[kind]:
            problems.append(f"{kind} {name}: apiVersion {doc.get('apiVersion')!r}, expected {K8S_API_VERSIONS[kind]!r}")
        if not name or not DNS1123.match(name) or len(name) > 63:
            problems.append(f"{kind}: metadata.name {name!r} is not a DNS-1123 label")
        if kind == "Secret" and (doc.get("data") or doc.get("stringData")):
            problems.append(f"Secret {name}: secret values must not be committed (create it with kubectl)")
    kinds = [d.get("kind") for d in docs]
    for want in ("RayCluster", "RayJob", "PersistentVolumeClaim", "ServiceAccount"):
        if want not in kinds:
            problems.append(f"no {want} manifest in infra/k8s")
    return problems


def _cluster_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for doc in docs:
        name = (doc.get("metadata") or {}).get("name")
        if doc.get("kind") == "RayCluster":
            out.append((f"RayCluster {name}", doc.get("spec") or {}))
        elif doc.get("kind") == "RayJob":
            out.append((f"RayJob {name}", (doc.get("spec") or {}).get("rayClusterSpec") or {}))
    return out


def _quantity(value) -> float:
    text = str(value)
    m = re.match(r"^([0-9.]+)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$", text)
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    scale = {
        None: 1,
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }[m.group(2)]
    return float(m.group(1)) * scale


def _pod_problems(
    where: str, pod: dict, pvcs: set[str], service_accounts: set[str], want_gpu: bool
) -> tuple[list[str], int]:
    """Problems of one pod template spec, and its GPU count."""
    problems = []
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    sa = pod.get("serviceAccountName")
    if not sa:
        problems.append(f"{where}: no serviceAccountName")
    elif sa not in service_accounts:
        problems.append(f"{where}: serviceAccountName {sa!r} has no ServiceAccount manifest in infra/k8s")
    cache_volumes = []
    for vname, vol in volumes.items():
        claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is not None:
            if claim not in pvcs:
                problems.append(f"{where}: volume {vname} claims {claim!r}, which has no PVC manifest")
            cache_volumes.append(vname)
    if not cache_volumes:
        problems.append(f"{where}: no PersistentVolumeClaim volume for the model cache")
    containers = pod.get("containers") or []
    if not containers:
        problems.append(f"{where}: no containers")
    gpus = 0
    for c in containers:
        found, gpu_count = _container_problems(f"{where} container {c.get('name')}", c, volumes, cache_volumes)
        problems += found
        gpus += gpu_count
    if want_gpu and gpus < 1:
        problems.append(f"{where}: GPU worker without an nvidia.com/gpu limit")
    if not want_gpu and gpus:
        problems.append(f"{where}: the head asks for GPUs; it should be a CPU pod")
    return problems, gpus


def _container_problems(cwhere: str, c: dict, volumes: dict, cache_volumes: list[str]) -> tuple[list[str], int]:
    """Problems of one container (image, mounts, cache dir, auth, resources), and its GPU limit."""
    problems = _image_problems(cwhere, c.get("image"))
    mounts = {m.get("name"): m.get("mountPath") for m in c.get("volumeMounts") or []}
    for mname in mounts:
        if mname not in volumes:
            problems.append(f"{cwhere}: volumeMount {mname!r} has no volume")
    if mounts.get("dshm") != "/dev/shm" and "/dev/shm" not in mounts.values():
        problems.append(f"{cwhere}: /dev/shm is not a memory volume (Ray's object store needs it)")
    env = {e.get("name"): e for e in c.get("env") or []}
    cache_dir = (env.get("CRITICALKV_CACHE_DIR") or {}).get("value")
    cache_mounts = [mounts[v] for v in cache_volumes if v in mounts]
    if not cache_dir:
        problems.append(f"{cwhere}: CRITICALKV_CACHE_DIR is not set")
    elif not any(cache_dir == m or cache_dir.startswith(m.rstrip("/") + "/") for m in cache_mounts):
        problems.append(
            f"{cwhere}: CRITICALKV_CACHE_DIR={cache_dir} is not on the model-cache PVC mount {cache_mounts}"
        )
    if env.get("RAY_AUTH_MODE", {}).get("value") == "disabled":
        problems.append(f"{cwhere}: RAY_AUTH_MODE=disabled")
    found, gpus = _resource_problems(cwhere, c.get("resources") or {})
    return problems + found, gpus


def _resource_problems(cwhere: str, res: dict) -> tuple[list[str], int]:
    """Requests/limits present and parseable, GPU request equal to its limit; the GPU limit."""
    problems = []
    limits, requests = res.get("limits") or {}, res.get("requests") or {}
    for key in ("cpu", "memory"):
        if key not in limits and key not in requests:
            problems.append(f"{cwhere}: no {key} request/limit")
    for kind_name, table in (("limits", limits), ("requests", requests)):
        for key, value in table.items():
            try:
                _quantity(value)
            except ValueError as exc:
                problems.append(f"{cwhere}: resources.{kind_name}.{key}: {exc}")
    gpu, gpus = limits.get("nvidia.com/gpu"), 0
    if gpu is not None:
        try:
            gpus = int(_quantity(gpu))
        except ValueError:
            pass
        if "nvidia.com/gpu" in requests and str(requests["nvidia.com/gpu"]) != str(gpu):
            problems.append(f"{cwhere}: nvidia.com/gpu request {requests['nvidia.com/gpu']} != limit {gpu}")
    return problems, gpus


def ray_cluster_spec_problems(where: str, spec: dict, pvcs: set[str], service_accounts: set[str]) -> list[str]:
    problems = []
    try:
        if Version(str(spec.get("rayVersion"))) < MIN_RAY_FOR_TOKEN_AUTH:
            problems.append(f"{where}: rayVersion {spec.get('rayVersion')} < {MIN_RAY_FOR_TOKEN_AUTH} (no token auth)")
    except Exception:  # noqa: BLE001
        problems.append(f"{where}: rayVersion {spec.get('rayVersion')!r} is not a version")
    auth = spec.get("authOptions") or {}
    if auth.get("mode") != "token":
        problems.append(f"{where}: authOptions.mode is {auth.get('mode')!r}, expected 'token'")
    if not spec.get("enableInTreeAutoscaling"):
        problems.append(f"{where}: enableInTreeAutoscaling is off (GPU workers should scale)")
    head = spec.get("headGroupSpec") or {}
    for key, value in (head.get("rayStartParams") or {}).items():
        if not isinstance(value, str):
            problems.append(f"{where}: head rayStartParams[{key}] must be a string, got {value!r}")
    head_problems, _ = _pod_problems(
        f"{where} head", (head.get("template") or {}).get("spec") or {}, pvcs, service_accounts, want_gpu=False
    )
    problems += head_problems
    groups = spec.get("workerGroupSpecs") or []
    names = [g.get("groupName") for g in groups]
    if len(set(names)) != len(names):
        problems.append(f"{where}: duplicate worker groupName in {names}")
    gpu_counts = []
    for g in groups:
        gwhere = f"{where} worker group {g.get('groupName')}"
        lo, hi, n = g.get("minReplicas"), g.get("maxReplicas"), g.get("replicas", g.get("minReplicas"))
        if not all(isinstance(x, int) for x in (lo, hi, n)) or not (0 <= lo <= n <= hi) or hi < 1:
            problems.append(
                f"{gwhere}: need 0 <= minReplicas <= replicas <= maxReplicas, maxReplicas >= 1 (got {lo}, {n}, {hi})"
            )
        for key, value in (g.get("rayStartParams") or {}).items():
            if not isinstance(value, str):
                problems.append(f"{gwhere}: rayStartParams[{key}] must be a string, got {value!r}")
        pod_problems, gpus = _pod_problems(
            gwhere, (g.get("template") or {}).get("spec") or {}, pvcs, service_accounts, want_gpu=True
        )
        problems += pod_problems
        gpu_counts.append(gpus)
    for want in (1, 8):
        if want not in gpu_counts:
            problems.append(f"{where}: no worker group with {want} GPU(s) per pod (got {gpu_counts})")
    return problems


def k8s_problems(docs: list[dict]) -> list[str]:
    problems = k8s_header_problems(docs)
    for doc in docs:
        problems += kuberay_schema_problems(doc)
    pvcs = {d["metadata"]["name"] for d in docs if d.get("kind") == "PersistentVolumeClaim"}
    sas = {d["metadata"]["name"] for d in docs if d.get("kind") == "ServiceAccount"}
    for where, spec in _cluster_specs(docs):
        problems += ray_cluster_spec_problems(where, spec, pvcs, sas)
    for doc in docs:
        if doc.get("kind") == "RayJob":
            spec = doc.get("spec") or {}
            if spec.get("ttlSecondsAfterFinished") and not spec.get("shutdownAfterJobFinishes"):
                problems.append("RayJob: ttlSecondsAfterFinished only acts with shutdownAfterJobFinishes: true")
    return problems


def _dockerfile_workdir() -> str:
    workdir = "/"
    for keyword, rest in dockerfile_instructions(DOCKERFILE.read_text()):
        if keyword == "WORKDIR":
            workdir = rest.strip()
    return workdir


def entrypoint_script(argv: list[str]) -> tuple[Path | None, list[str], list[str]]:
    """(script in the repo, its arguments, problems) for an entrypoint's argv."""
    problems = []
    if not argv or argv[0] != "python":
        problems.append(f"entrypoint should start with the image's `python`, got {argv[:1]}")
        return None, [], problems
    if len(argv) < 2:
        return None, [], ["entrypoint runs no script"]
    script = argv[1]
    workdir = _dockerfile_workdir().rstrip("/") + "/"
    rel = script.removeprefix(workdir)
    if not re.match(r"^jobs/[A-Za-z0-9_]+\.py$", rel):
        problems.append(f"entrypoint script {script!r} is not jobs/<name>.py (relative to the image WORKDIR {workdir})")
        return None, argv[2:], problems
    return REPO / rel, argv[2:], problems


class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


def parse_job_args(script: Path, args: list[str]) -> tuple[argparse.Namespace | None, str]:
    """Run ``script`` as __main__ until its argparse parser has parsed ``args`` (then stop).

    Returns (namespace, "") or (None, what the parser printed) when it rejects the arguments.
    Only ``ArgumentParser.parse_args`` is intercepted (``parse_known_args`` pre-parsers run as usual).
    """
    original = argparse.ArgumentParser.parse_args

    def intercept(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    err, out = io.StringIO(), io.StringIO()
    try:
        with (
            mock.patch.object(argparse.ArgumentParser, "parse_args", intercept),
            mock.patch.object(sys, "argv", [str(script), *args]),
            redirect_stderr(err),
            redirect_stdout(out),
        ):
            runpy.run_path(str(script), run_name="__main__")
    except _Parsed as parsed:
        return parsed.namespace, ""
    except SystemExit as exc:
        return None, f"exit {exc.code}: {err.getvalue().strip() or out.getvalue().strip()}"
    return None, "the script never parsed its arguments"


def entrypoint_problems(entrypoint: str) -> list[str]:
    argv = shlex.split(entrypoint)
    script, args, problems = entrypoint_script(argv)
    if script is None:
        return problems
    if not script.is_file():
        return problems + [f"entrypoint script {script.relative_to(REPO)} does not exist"]
    namespace, message = parse_job_args(script, args)
    if namespace is None:
        return problems + [f"{script.relative_to(REPO)} rejects the entrypoint's arguments ({message})"]
    for flag in ("--input", "--output"):
        if flag not in args:
            problems.append(f"entrypoint passes no {flag}")
            continue
        value = args[args.index(flag) + 1]
        if not value.startswith(OBJECT_STORE_SCHEMES):
            problems.append(f"{flag} {value!r} is not an object storage URI ({', '.join(OBJECT_STORE_SCHEMES)})")
    return problems


def _rayjob_entrypoints(docs: list[dict]) -> list[str]:
    return [d["spec"]["entrypoint"] for d in docs if d.get("kind") == "RayJob"]


def _require_job_scripts(entrypoints: list[str]) -> None:
    for entrypoint in entrypoints:
        script, _, _ = entrypoint_script(shlex.split(entrypoint))
        if script is not None and not script.is_file():
            pytest.fail(f"{script.relative_to(REPO)}, named by {entrypoint!r}, does not exist")


def _readme_job_commands() -> list[str]:
    """`python jobs/<x>.py ...` commands in infra/README.md code blocks (continuations joined)."""
    text = (INFRA / "README.md").read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.DOTALL):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            m = re.search(r"python ((?:/\S*/)?jobs/[A-Za-z0-9_]+\.py.*)$", line)
            if m:
                commands.append("python " + m.group(1).split(" #")[0].strip())
    return commands
