"""The core's shape in numbers, for a refactor's before and after (no model, no timing).

Prints: the import graph inside ``pipeline/kv`` counting *every* import (module level, inside
functions and under ``TYPE_CHECKING``: a circle there is a circle a reader follows) -- its circles and
its number of levels; the public methods of the compressor and of the variable-length cache and the
cache module's lines; the method names ``--help`` lists; the lines of ``benchmarks/``; the size and
file count of ``docs/``. Duplicate-code pairs come from the library's ``duplicates`` command.

    python -m benchmarks.code_shape
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KV = ROOT / "pipeline" / "kv"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kv_import_graph() -> dict[str, set[str]]:
    """Module -> the ``pipeline.kv`` modules it imports anywhere in its text (relative imports resolved)."""
    modules = {_module_name(p): p for p in KV.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    stem = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(stem + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in modules else base)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def levels(graph: dict[str, set[str]]) -> int:
    """The longest import chain's length in modules (circles collapsed to their first visit)."""
    depth: dict[str, int] = {}

    def visit(node: str, path: frozenset) -> int:
        if node in depth:
            return depth[node]
        below = [visit(n, path | {node}) for n in graph[node] if n not in path]
        depth[node] = 1 + max(below, default=0)
        return depth[node]

    return max(visit(n, frozenset()) for n in graph)


def public_methods(cls: type) -> list[str]:
    """Public callables and properties a class defines or inherits from ``pipeline``'s own classes."""
    names = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("pipeline"):
            continue
        public = {n: v for n, v in vars(klass).items() if not n.startswith("_")}
        names |= {n for n, v in public.items() if callable(v) or isinstance(v, property)}
    return sorted(names)


def main() -> None:
    from pipeline.kv.compress import Compressor
    from pipeline.kv.config import method_names
    from pipeline.kv.storage import cache as cache_module

    graph = kv_import_graph()
    found = circles(graph)
    print(f"pipeline/kv: {len(graph)} modules, {levels(graph)} import levels, {len(found)} circle(s)")
    for component in found:
        print("  circle:", " <-> ".join(m.removeprefix("pipeline.kv.") for m in component))
    print(f"Compressor: {len(public_methods(Compressor))} public methods and properties")
    print(f"VarLenCache: {len(public_methods(cache_module.VarLenCache))} public methods and properties, "
          f"{cache_module.__name__} {len(inspect.getsource(cache_module).splitlines())} lines")  # fmt: skip
    print(f"method names in --help: {len(method_names())}")
    bench = [p for p in (ROOT / "benchmarks").rglob("*.py")]
    print(f"benchmarks/: {len(bench)} Python files, {sum(len(p.read_text().splitlines()) for p in bench)} lines")
    docs = [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    print(f"docs/: {len(docs)} files, {sum(p.stat().st_size for p in docs) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
