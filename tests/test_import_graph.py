"""The package's house rules, read from its source: no import loop, no module over 500 lines.

Every import of one ``prefix_sharing`` module by another counts, those inside functions too:
a deferred import that closes a loop still ties the two modules into one (the loops this test
was written against all hid that way). Imports of other packages do not count.
"""

from __future__ import annotations

import ast
import pathlib

import prefix_sharing

PACKAGE = pathlib.Path(prefix_sharing.__file__).parent

MAX_LINES = 500
# Modules allowed over MAX_LINES, each with its reason (none today).
LONG_MODULES: dict[str, str] = {}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``name`` imports, anywhere in its source (a package's submodule
    when ``from package import submodule``, else the nearest enclosing package module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                          for alias in node.names]
        else:
            continue
        for target in candidates:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    return targets


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return loops


def test_no_module_imports_itself_through_others():
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert _loops(graph) == []


def test_a_deferred_import_closes_a_loop(tmp_path):
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    modules = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py", "p": tmp_path / "x.py"}
    graph = {name: _imported(name, path, modules) for name, path in modules.items()
             if name != "p"}
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.a"}}
    assert _loops(graph) == [["p.a", "p.b"]]


def test_no_module_is_over_500_lines_but_the_named_ones():
    long = {name for name, path in _modules().items()
            if len(path.read_text().splitlines()) > MAX_LINES}
    assert long == set(LONG_MODULES)
