"""The test tree's own rules: tests reach shared code through ``tests.support`` only.

- No file under ``tests/`` edits ``sys.path``: pytest's ``pythonpath`` (pyproject.toml) and
  the package tree make ``statetier``, ``tests.support`` and ``examples`` importable.
- No test module imports another test module: what two suites share lives in ``tests/support``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SOURCES = sorted(TESTS.rglob("*.py"))


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def sys_path_edits(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value):
            lines.append(node.lineno)  # sys.path.insert / append / extend / remove …
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [node.lineno for target in targets if _is_sys_path(target)]
    return sorted(lines)


def imported_test_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return [name for name in names if name.split(".")[-1].startswith("test_") or name.startswith("test_")]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_file_edits_sys_path_or_imports_a_test_module(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    assert sys_path_edits(tree) == [], "import through tests.support / pytest's pythonpath instead"
    assert imported_test_modules(tree) == [], "move what is shared into tests/support"


def test_the_rules_see_what_they_forbid() -> None:
    tree = ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path += ['y']\nfrom test_disk import objects\n"
                     "import tests.tiers.test_redis\nfrom tests.support.waiting import wait_until\n")
    assert sys_path_edits(tree) == [2, 3]
    assert imported_test_modules(tree) == ["test_disk", "tests.tiers.test_redis"]
