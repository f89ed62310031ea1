"""The package's shape: files and functions a reader can hold in view, and imports without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKED = ["lightning_memrl", "callbacks", "benchmarks", "examples"]  # everything but the tests
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def _python_files() -> list[Path]:
    files = []
    for name in CHECKED:
        path = REPO / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_files_and_functions_stay_small(path: Path) -> None:
    source = path.read_text()
    assert source.count("\n") <= MAX_FILE_LINES, f"{path.name}: {source.count(chr(10))} lines"
    long = {
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {sorted(long)}"


def test_the_lightning_module_stays_a_list_of_hooks() -> None:
    tree = ast.parse((REPO / "lightning_memrl" / "module.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MemRLModule"]
    assert cls.end_lineno - cls.lineno + 1 <= 350


def _package_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (``callbacks/`` installs as ``lightning_memrl.callbacks``)."""
    modules = {}
    for root, prefix in (
        (REPO / "lightning_memrl", "lightning_memrl"),
        (REPO / "callbacks", "lightning_memrl.callbacks"),
    ):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([prefix, *parts])] = path
    return modules


def _imports(tree: ast.Module, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at top level)`` of each first-party import (a submodule when one is named)."""
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_memrl"):
            targets = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            found += [(t, node.lineno, id(node) in top) for t in targets or [node.module]]
        elif isinstance(node, ast.Import):
            found += [
                (a.name, node.lineno, id(node) in top) for a in node.names if a.name.startswith("lightning_memrl")
            ]
    return found


def test_no_import_cycle_and_no_import_inside_a_function() -> None:
    modules = _package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        source = path.read_text()
        assert "TYPE_CHECKING" not in source, f"{path}: a type-checking-only import hides a cycle"
        imports = _imports(ast.parse(source), modules)
        assert [(m, line) for m, line, top in imports if not top] == [], f"{path}: first-party import in a function"
        graph[name] = {m for m, _, _ in imports if m in modules and not name.startswith(m + ".")}
    # a package's __init__ re-exports its modules; an edge into a package is an edge into them
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == "lightning_memrl":  # the top-level re-exports; its own modules never import it
                continue
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, nxt])
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
