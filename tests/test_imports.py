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
        "import sys, statetier.clients.vllm, statetier.clients.vllm.scheduler, statetier.clients.vllm.jobs\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


PACKAGES = {"protocol": "statetier.protocol", "tiers": "statetier.tiers", "daemon": "statetier.daemon",
            "clients": "statetier.clients", "launch": "statetier.launch", "benchmarks": "statetier.benchmarks"}

# Which packages each package may import (docs/architecture.md): the arrows run one way.
ALLOWED = {
    "protocol": set(),
    "tiers": {"protocol"},
    # daemon.cli (a package) is the ``statetier`` command: its client subcommands use the SDK, and
    # ``statetier bench`` enters the benchmarks lazily; no other daemon module does either
    "daemon": {"protocol", "tiers", "clients", "benchmarks"},
    "clients": {"protocol"},
    "launch": {"protocol", "clients"},
    "benchmarks": {"protocol", "tiers", "daemon", "clients", "launch"},
}


def _modules() -> dict[str, Path]:
    """Every module of the package (subpackages included) → its file."""
    root = Path(__file__).resolve().parent.parent
    modules = {}
    for folder, package in PACKAGES.items():
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _import_graph(*, packages_too: bool = False) -> dict[str, set[str]]:
    """Every statetier module's imports of other statetier modules, lazy ones included
    (``packages_too``: an ``__init__`` counts as the module it is)."""
    import ast

    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.stem == "__init__"
        if is_package and not packages_too:
            continue
        package = name if is_package else name.rsplit(".", 1)[0]
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
            if nxt not in graph:
                continue  # a package's __init__: its own imports are checked as modules
            if nxt == path[0]:
                circles.append(" -> ".join(path + [nxt]))
            elif nxt not in path and nxt > path[0]:  # each circle once, from its smallest module
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert circles == []


def test_each_package_imports_only_what_the_architecture_allows() -> None:
    def top(module: str) -> str:
        return module.split(".")[1]

    graph = _import_graph(packages_too=True)
    wrong = sorted(f"{module} imports {target}" for module, targets in graph.items()
                   for target in targets if top(target) != top(module) and top(target) not in ALLOWED[top(module)])
    assert wrong == []
    upward = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                    if top(module) == "daemon" and top(target) in ("clients", "benchmarks")
                    and not module.startswith("statetier.daemon.cli"))
    assert upward == []


def test_the_daemons_server_and_engine_meet_only_in_the_composition_root() -> None:
    """The server calls the engine it is given (``daemon.app`` wires them); neither imports
    the other, so the wire side and the tier side can be read, and changed, apart."""
    graph = _import_graph(packages_too=True)

    def part(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "daemon" and parts[2] in ("engine", "server") else None

    crossing = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                      if part(module) and part(target) and part(module) != part(target))
    assert crossing == []
