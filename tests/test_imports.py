"""The client side stays light: importing it loads no heavy or server-side dependency."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "redis", "lmdb", "prometheus_client", "uvloop")


def test_protocol_and_clients_import_without_heavy_dependencies() -> None:
    probe = (
        "import sys, statetier.protocol, statetier.clients\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_vllm_connector_module_imports_without_vllm_or_torch() -> None:
    """vLLM (and torch) load only when ``StatetierConnector`` is used, so the module imports
    on any machine; the connector's plain logic modules are light too, save the worker's torch."""
    probe = (
        "import sys, statetier.clients.vllm, statetier.clients.vllm_scheduler, statetier.clients.vllm_jobs\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


PACKAGES = {"protocol": "statetier.protocol", "tiers": "statetier.tiers", "daemon": "statetier.daemon",
            "clients": "statetier.clients"}


def _import_graph() -> dict[str, set[str]]:
    """Every statetier module's imports of other statetier modules, lazy ones included."""
    import ast

    root = Path(__file__).resolve().parent.parent
    modules = {f"{package}.{path.stem}": path for folder, package in PACKAGES.items()
               for path in (root / folder).glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package if node.level else ""
                if node.level > 1:
                    base = base.rsplit(".", node.level - 1)[0]
                target = ".".join(part for part in (base, node.module or "") if part)
                candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            found.update(c for c in candidates if c in modules and c != name)
        graph[name] = found
    return graph


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    graph = _import_graph()
    assert len(graph) > 40
    circles = []

    def visit(name: str, path: list[str]) -> None:
        for nxt in sorted(graph[name]):
            if nxt == path[0]:
                circles.append(" -> ".join(path + [nxt]))
            elif nxt not in path and nxt > path[0]:  # each circle once, from its smallest module
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert circles == []
