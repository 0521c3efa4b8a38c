"""Every code name ``docs/ARCHITECTURE.md`` cites in backticks exists: file paths (from the repository
root or ``pipeline/``), ``pipeline.*`` dotted names, ``Class.member`` of a class defined in
``pipeline/``, and method names (they must parse)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from pipeline.kv.config import parse_method

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
NAMES = sorted(set(re.findall(r"`([^`\s]+)`", TEXT)))


def _classes() -> dict[str, str]:
    """Class name -> module of every class defined in pipeline/."""
    out = {}
    for path in (ROOT / "pipeline").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, module)
    return out


CLASSES = _classes()


def _instance_attrs(cls) -> set[str]:
    """Attributes a class's methods assign on ``self`` (``self.kernels = ...``)."""
    tree = ast.parse(inspect.getsource(cls))
    return {
        t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Attribute)
    }


def _exists(name: str) -> bool | None:
    """True / False for a name this test can check, None for prose in backticks."""
    name = name.removesuffix("()")
    if re.fullmatch(r"[\w./-]+\.(py|md|sh|yaml|json)", name) and "/" in name:  # a bare name: an output file
        return (ROOT / name).exists() or (ROOT / "pipeline" / name).exists()
    if re.fullmatch(r"pipeline(\.\w+)+", name):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
        return False
    match = re.fullmatch(r"([A-Z]\w+)\.(\w+)", name)
    if match and match.group(1) in CLASSES:
        cls = getattr(importlib.import_module(CLASSES[match.group(1)]), match.group(1))
        member = match.group(2)
        return hasattr(cls, member) or member in getattr(cls, "__annotations__", {}) or member in _instance_attrs(cls)
    if re.fullmatch(r"[a-z]+(-[a-z0-9_]+)+", name) and name.split("-")[0] in ("criticalkv", "layer", "shares", "adakv"):
        try:
            parse_method(name)
            return True
        except ValueError:
            return False
    return None


@pytest.mark.parametrize("name", NAMES)
def test_a_cited_code_name_exists(name):
    assert _exists(name) is not False, f"docs/ARCHITECTURE.md cites `{name}`, which does not exist"


def test_the_check_sees_enough_names_and_catches_a_missing_one():
    checked = [n for n in NAMES if _exists(n) is not None]
    assert len(checked) >= 60
    assert _exists("kv/nothing_here.py") is False and _exists("pipeline.kv.no_such_thing") is False
    assert _exists("VarLenCache.no_such_method") is False and _exists("criticalkv-layerfloor-kvzap") is False
