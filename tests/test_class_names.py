"""Every class name names one class in the package: a reader who greps a name finds one thing."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "tiers", "daemon", "clients", "launch", "benchmarks", "statetier")

# The daemon's side of a connection (``daemon.server.connection``) and the SDK's (the public
# ``statetier.clients.Connection``): the server's is left to the issue that rewrites the server.
KNOWN = {"Connection": {"daemon/server/connection.py", "clients/transport.py"}}


def classes_by_name() -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    found[node.name].add(str(path.relative_to(REPO)))
    return found


def test_no_two_classes_of_the_package_share_a_name() -> None:
    found = classes_by_name()
    assert len(found) > 300  # the whole package was read
    shared = {name: files for name, files in found.items() if len(files) > 1}
    assert shared == KNOWN
