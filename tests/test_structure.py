"""The code's shape, checked: the module import graph of ``pipeline/`` has no cycle and follows the
rooms' layering, the report does not need torch, modules and functions stay small.

Layers (``docs/ARCHITECTURE.md``): ``kv`` <- ``engine`` <- {``distributed``, ``eval``} <- ``apps``, with
``data`` (and the small top-level helpers ``options``, ``hooks``) at the ground and ``report`` on
``data`` only. An arrow means "may import"; nothing imports upwards or sideways between
``distributed`` and ``eval``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeline"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60

# room -> rooms it may import (besides itself); "ground" modules may be imported by everyone
ALLOWED = {
    "ground": set(),
    "data": {"ground"},
    "kv": set(),  # pure tensors: nothing of the package outside itself (its CLI help is laid out elsewhere)
    "engine": {"ground", "data", "kv"},
    "distributed": {"ground", "data", "kv", "engine"},
    "eval": {"ground", "data", "kv", "engine"},
    "report": {"ground", "data"},
    "apps": {"ground", "data", "kv", "engine", "distributed", "eval", "report"},
    "top": {"ground", "data", "kv", "engine", "distributed", "eval", "report", "apps"},
}
GROUND = {"pipeline", "pipeline.options", "pipeline.hooks"}
TOP = {"pipeline.generate", "pipeline.compact"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _room(module: str) -> str:
    if module in GROUND:
        return "ground"
    if module in TOP:
        return "top"
    return module.split(".")[1]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def module_level_imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ``pipeline`` imported by ``module`` when it is imported: everything outside function
    bodies and ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):  # a submodule when the name is one, else the package itself
            target = _resolve(module, path, node)
            found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != module}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: module_level_imports(name, path, set(modules)) for name, path in modules.items()}


def test_import_graph_has_no_cycle(graph):
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_rooms_import_only_downwards(graph):
    wrong = []
    for module, targets in graph.items():
        room = _room(module)
        for target in targets:
            other = _room(target)
            if other != room and other not in ALLOWED[room] and not (module.startswith(target + ".")):
                wrong.append(f"{module} ({room}) imports {target} ({other})")
    assert not wrong, "\n".join(sorted(wrong))


def test_report_imports_without_torch():
    code = "import sys, pipeline.report; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_modules_and_functions_are_small():
    too_long = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    long_functions = [f for p in sorted(PACKAGE.rglob("*.py")) for f in _long_functions(p)]
    assert not too_long and not long_functions, "\n".join(too_long + long_functions)


def test_code_refers_to_no_file_outside_the_repository():
    mentions = [f"{p.relative_to(ROOT)}" for p in sorted(PACKAGE.rglob("*.py")) if "DESIGN.md" in p.read_text()]
    assert not mentions, f"DESIGN.md is not in the repository; see docs/ARCHITECTURE.md: {mentions}"


def _sys_path_edits(path: Path) -> list[int]:
    """Lines of ``path`` that change ``sys.path`` (an assignment, a slice, or a mutating call)."""
    edits = []
    for node in ast.walk(ast.parse(path.read_text())):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value  # sys.path.insert(...), .append, .extend, .remove
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets), None)
        if isinstance(target, ast.Attribute) and target.attr == "path":
            if isinstance(target.value, ast.Name) and target.value.id == "sys":
                edits.append(node.lineno)
    return sorted(edits)


def test_no_file_edits_sys_path():
    """Entry points import the installed package (``make setup`` installs it; ``ray job submit
    --working-dir .`` puts the directory on PYTHONPATH), the benchmarks run as ``python -m benchmarks.NAME``
    from the repository root: no script patches the import path."""
    files = [p for p in ROOT.rglob("*.py") if not {".venv", "outputs", ".git"} & set(p.relative_to(ROOT).parts)]
    edits = {str(p.relative_to(ROOT)): lines for p in sorted(files) if (lines := _sys_path_edits(p))}
    assert not edits, f"sys.path edited in {edits}"
    assert _sys_path_edits_example() == [2, 3, 4]


def _sys_path_edits_example() -> list[int]:
    """The detector on a sample (so the test cannot pass by detecting nothing)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write("import sys\nsys.path.insert(0, 'x')\nsys.path[:] = []\nsys.path += ['y']\nos.path.join('a')\n")
    try:
        return _sys_path_edits(Path(fh.name))
    finally:
        Path(fh.name).unlink()


def test_every_console_script_names_a_callable_entry_point():
    """pyproject's [project.scripts] (the jobs and tools as installed commands) import and are callable."""
    import importlib

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the dev extra's tomli
        import tomli as tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"criticalkv-longdoc-qa", "criticalkv-summarize", "criticalkv-eval", "criticalkv-report"} <= set(scripts)
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name


# (file, enclosing function) of every environment read in the kv and engine rooms: each is read once,
# when a cache or a model is set up, never on a per-call path (the attention calls, the decode steps)
ALLOWED_ENVIRONMENT_READS = {
    ("pipeline/kv/attention/varlen_kernels.py", "from_environment"),  # KernelChoice: once per cache (VarLenCache)
    ("pipeline/engine/loading.py", "default_cache_dir"),  # where converted GGUF models are kept
    ("pipeline/engine/model_source.py", "hub_offline"),  # HF_HUB_OFFLINE: once per model fetch or pre-flight
}


def _environment_reads(path: Path) -> set[tuple[str, str]]:
    """(file, enclosing function) of each ``os.environ`` / ``os.getenv`` in ``path``."""
    tree = ast.parse(path.read_text())
    reads = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                reads.add((str(path.relative_to(ROOT)), func.name))
    module_level = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    for stmt in module_level:
        if any(isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv") for n in ast.walk(stmt)):
            reads.add((str(path.relative_to(ROOT)), "<module>"))
    return reads


def test_the_kv_and_engine_rooms_read_the_environment_only_where_pinned():
    reads = set()
    for room in ("pipeline/kv", "pipeline/engine"):
        for path in sorted((ROOT / room).rglob("*.py")):
            reads |= _environment_reads(path)
    assert reads == ALLOWED_ENVIRONMENT_READS


def test_the_kv_core_has_no_import_circle_even_through_annotations():
    """Inside ``pipeline/kv`` no module imports another that imports it back, counting imports inside
    functions and under ``TYPE_CHECKING`` too (a circle a reader follows is a circle)."""
    from benchmarks.code_shape import circles, kv_import_graph

    graph = kv_import_graph()
    assert "pipeline.kv.prefill.rules" in graph and graph["pipeline.kv.config"]  # the walk sees the package
    assert circles(graph) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]  # the detector detects
