"""The house stays livable (read from the code's own definitions and imports, so a change that breaks a rule
fails here): no class over 300 lines, no function over 90, no import cycle between vlguard's modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server"
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 90


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in SERVER.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """vlguard modules ``path`` imports, wherever the import stands (module level, in a function, under
    ``TYPE_CHECKING``): ``from a.b import c`` names ``a.b.c`` where that is a module, else ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("server"):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}  # fmt: skip
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
    return {m for m in found if m in MODULES}


def _own_face(a: str, b: str) -> bool:
    """An import between a package's ``__init__`` and a module inside that package (the package's face
    handing on its own names) is not an edge between two rooms."""
    return (MODULES[a].name == "__init__.py" and b.startswith(a + ".")) or (
        MODULES[b].name == "__init__.py" and a.startswith(b + ".")
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    graph = {m: {d for d in _imports(p) if d != m and not _own_face(m, d)} for m, p in MODULES.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_class_over_300_lines_and_no_function_over_90() -> None:
    found = []
    for path in sorted(SERVER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                found.append(f"{path.relative_to(ROOT)}: class {node.name} has {lines} lines")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}: {node.name}() has {lines} lines")
    assert found == []
