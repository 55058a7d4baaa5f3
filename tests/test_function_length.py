"""No function of the product packages is longer than a reader can hold: 60 lines at most.

Counted from its ``def`` line to its last line, docstring and comments included, in every
module of ``protocol``, ``tiers``, ``daemon``, ``clients``, ``launch`` and ``benchmarks``.
``STILL_LONG`` names what is over it today and is being cut elsewhere; an entry leaves the
list when its function shrinks (the test says so), and nothing joins it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "tiers", "daemon", "clients", "launch", "benchmarks")
LIMIT = 60

#: ``path::function`` → why it is still long (and who cuts it)
STILL_LONG: dict[str, str] = {}


def long_functions() -> dict[str, int]:
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > LIMIT:
                        found[f"{path.relative_to(ROOT).as_posix()}::{node.name}"] = lines
    return found


def test_no_function_of_the_product_packages_is_over_60_lines() -> None:
    found = long_functions()
    assert {name: lines for name, lines in found.items() if name not in STILL_LONG} == {}
    assert set(STILL_LONG) <= set(found), f"shorter now, strike from STILL_LONG: {set(STILL_LONG) - set(found)}"
