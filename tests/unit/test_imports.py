"""The package's import graph, drawn from the source with ``ast`` (every import: module level, inside
functions, under ``TYPE_CHECKING``), holds no circle: no module, and no sub-package taken whole
(``tasks/entity_tracking/``), reaches itself."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mechdiff"


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file (a package is its ``__init__.py``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports: ``from .x import y`` names ``x.y`` where
    ``y`` is a module, else ``x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


@functools.cache  # the source is parsed once per process for each form (a second or more each); tests only read it
def graph(collapse: bool = False) -> dict[str, set[str]]:
    """Module -> modules it imports; ``collapse``: every module of a sub-package (``mechdiff.a.b.*``, ``b`` a
    package) is the sub-package."""
    mods = modules()
    known = set(mods)
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}

    def node(m: str) -> str:
        parts = m.split(".")
        for depth in range(3, len(parts) + 1):
            if collapse and ".".join(parts[:depth]) in packages:
                return ".".join(parts[:depth])
        return m

    g: dict[str, set[str]] = {}
    for m, p in mods.items():
        g.setdefault(node(m), set()).update(node(t) for t in imported(m, p, known))
    return {m: targets - {m} for m, targets in g.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_relative_and_function_level_imports():
    g = graph()
    assert "mechdiff.tasks.records" in g["mechdiff.tasks.jsonl"]  # from .records import ...
    assert "mechdiff.models.remote" in g["mechdiff.models.loading"]
    # a cycle planted in a copy of the graph is found
    planted = {k: set(v) for k, v in g.items()}
    planted["mechdiff.tasks.records"].add("mechdiff.tasks.row_checks")
    assert ["mechdiff.tasks.records", "mechdiff.tasks.row_checks"] in circles(planted)


@pytest.mark.parametrize(
    "pair",
    [
        ("mechdiff.models.loading", "mechdiff.models.remote"),
        ("mechdiff.tasks.base", "mechdiff.tasks.jsonl"),
        ("mechdiff.tasks.entity_tracking", "mechdiff.tasks.splits"),
    ],
)
def test_issue_circles_are_gone(pair):
    for collapse in (False, True):
        for comp in circles(graph(collapse)):
            assert not set(pair) <= set(comp), comp


#: The circle issue 28's study move removes (study.py -> studies/circuits.py, the report reading stage results).
PENDING: set[frozenset] = set()


def test_no_other_circle():
    for collapse in (False, True):
        assert [c for c in circles(graph(collapse)) if frozenset(c) not in PENDING] == []
