"""Checks of infra/docker/Dockerfile and .dockerignore against the Makefile and pyproject.

Each check returns a list of problems.
"""

from __future__ import annotations

import re
import shlex

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.infra.infra_common import REPO


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
    return re.sub(
        r"\$\{(\w+)\}|\$\((\w+)\)|\$(\w+)",
        lambda m: variables.get(m.group(1) or m.group(2) or m.group(3), m.group(0)),
        text,
    )


_PIP_VALUE_OPTIONS = {
    "-c",
    "--constraint",
    "-r",
    "--requirement",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "--target",
    "-t",
    "--prefix",
    "--upgrade-strategy",
    "-e",
    "--editable",
}


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
            while (
                j < len(tokens) and not re.fullmatch(r"[;&|()]+", tokens[j]) and tokens[j] not in ("then", "fi", "else")
            ):
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
            installs.append(
                {
                    "args": args,
                    "specs": specs,
                    "no_deps": "--no-deps" in options,
                    "index_url": (options.get("--index-url") or options.get("-i") or [None])[0],
                }
            )
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
        problems.append(
            f"the Dockerfile installs extras {sorted(docker['extras'])}, "
            f"missing the Makefile's {sorted(make['extras'] - docker['extras'])}"
        )
    if not docker["extras"] <= declared:
        problems.append(
            f"the Dockerfile asks for extras {sorted(docker['extras'] - declared)} that pyproject does not define"
        )
    if docker["no_deps"] != make["no_deps"]:
        problems.append(
            f"--no-deps packages differ: Dockerfile {sorted(docker['no_deps'])}, Makefile {sorted(make['no_deps'])}"
        )
    torch_installs = [i for i in installs if any(re.match(r"^torch==", s) for s in i["specs"])]
    if not torch_installs:
        problems.append("the Dockerfile does not install a pinned torch")
    else:
        if not any(i["index_url"] and "/whl/cu" in i["index_url"] for i in torch_installs):
            problems.append("torch is not taken from a CUDA wheel index (--index-url .../whl/cuXXX)")
        if (
            "torch" not in docker["order"]
            or "project" not in docker["order"]
            or docker["order"].index("torch") > docker["order"].index("project")
        ):
            problems.append("CUDA torch must be installed before the project (else pip picks its own torch)")
        pinned = next(s for i in torch_installs for s in i["specs"] if s.startswith("torch=="))[len("torch==") :]
        torch_spec = next((d for d in pyproject["project"]["dependencies"] if re.match(r"^torch\b", d)), None)
        if torch_spec and Version(pinned) not in SpecifierSet(torch_spec[len("torch") :].strip()):
            problems.append(f"the image's torch {pinned} is outside pyproject's {torch_spec}")
        if make_vars.get("TORCH_VERSION") and pinned != make_vars["TORCH_VERSION"]:
            problems.append(
                f"the image's torch {pinned} differs from the Makefile's TORCH_VERSION {make_vars['TORCH_VERSION']}"
            )
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
    for junk in (
        ".git/HEAD",
        ".venv/bin/python",
        "outputs/run/data/x.parquet",
        "pipeline/__pycache__/x.pyc",
        "criticalkv_pipeline.egg-info/PKG-INFO",
        ".pytest_cache/v/x",
    ):
        if not dockerignore_excludes(rules, junk):
            problems.append(f".dockerignore keeps {junk} in the build context")
    return problems
