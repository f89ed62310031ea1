"""Size limits a reader can hold in view: no file over 400 lines, no function over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKED = [  # folders and files held to the limits
    "lightning_memrl/memory",
    "lightning_memrl/data",
    "lightning_memrl/models.py",
    "lightning_memrl/model_paths.py",
    "lightning_memrl/distributed.py",
    "benchmarks",
]
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
