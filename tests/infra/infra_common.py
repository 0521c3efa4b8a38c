"""Shared pieces of the offline infra checks: paths, loaders, the project image rule, mutation helpers."""

from __future__ import annotations

import copy
from pathlib import Path

import ray  # noqa: F401 - a hard dependency: missing, these checks fail rather than skip
import yaml
from packaging.version import Version

from tests.dev_extra import require_dev

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = require_dev("tomli")
jsonschema = require_dev("jsonschema")


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


def _dig(obj, path):
    for key in path:
        obj = obj[key]
    return obj
