"""What the deploy tests read: the files under ``deploy/`` and the metric names the daemon exports.

- ``DEPLOY``, ``REPO`` — paths; ``load_yaml_documents(path)`` — every document of a YAML file.
- ``containerfile_instructions(path)`` — ``[(INSTRUCTION, argument text)]`` of a Containerfile,
  continuation lines joined, comments dropped (enough for static checks; no engine here).
- ``exported_metric_names()`` — every family name a live ``Metrics`` exposes once all of
  its scrape-time parts are tracked, plus the ``_bucket``/``_count``/``_sum`` sample names.
- ``metric_names_in(expr)`` — the ``statetier_*`` names a PromQL expression mentions.
- ``pod_specs(documents)`` — ``(kind/name, pod spec)`` of every workload in manifests.
- ``package_folders()`` — every import package of the tree (a folder with an ``__init__.py`` under
  a root pyproject.toml maps), as the wheel must hold it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from statetier.daemon.metrics import Metrics
from statetier.tiers.base import TierStats

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
_WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "Pod"}


def load_yaml_documents(path: Path) -> list[dict]:
    with path.open() as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def containerfile_instructions(path: Path) -> list[tuple[str, str]]:
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        text = (pending + line).strip()
        pending = ""
        word, _, rest = text.partition(" ")
        instructions.append((word.upper(), rest.strip()))
    assert not pending, f"{path}: the last instruction ends with a continuation"
    return instructions


def exported_metric_names() -> set[str]:
    metrics = Metrics()
    extra = {"available": True, "leases_expired": 0, "lease_violations": 0, "checkpoint_failures": 0,
             "dead_bytes": 0, "recovery_dropped": 0, "recovery_unverified": 0}
    daemon = {key: 0 for key in ("connections", "inflight_requests", "budget_bytes_in_use", "budget_bytes_limit",
                                 "budget_waiters", "leases", "write_behind_pending", "write_behind_limit")}
    daemon["tenants"] = {"default": {"host": {"used": 0, "quota": 1}}}
    metrics.track(lambda: [TierStats("host", 0, 0, 1, 0, 0, extra=extra)], lambda: daemon)
    metrics.set_redis_available(True)
    for name in ("observe_op", "count_hit", "count_miss", "count_error", "count_auth_failure",
                 "count_purged", "count_demotion", "count_promotion"):
        _touch(metrics, name)
    metrics.observe_lookup(16, 0.001)
    names: set[str] = set()
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        names.add(family.name if family.type != "counter" else family.name + "_total")
        names.update(sample.name for sample in family.samples)
    return names


def _touch(metrics: Metrics, method: str) -> None:
    """Give every labelled family one child so it shows up in the exposition."""
    args = {"observe_op": ("host", "kv", "put", 1, 0.001), "count_hit": ("host", "kv"), "count_miss": ("kv",),
            "count_error": ("busy",), "count_auth_failure": ("unauthorized",), "count_purged": ("host", 1),
            "count_demotion": ("host", "disk"), "count_promotion": ("disk", "host")}[method]
    getattr(metrics, method)(*args)


def metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bstatetier_[a-z0-9_]+\b", expr))


def pod_specs(documents: list[dict]) -> list[tuple[str, dict]]:
    specs = []
    for doc in documents:
        if doc.get("kind") not in _WORKLOADS:
            continue
        spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
        specs.append((f"{doc['kind']}/{doc['metadata']['name']}", spec))
    return specs


def package_folders() -> list[str]:
    """Every import package of the tree: each folder with an ``__init__.py`` under a root that
    pyproject.toml's ``[tool.setuptools.package-dir]`` maps, named as it is imported."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = []
    for name, folder in mapping.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if "__pycache__" not in parts:
                found.append(".".join((name, *parts)))
    return sorted(found)
