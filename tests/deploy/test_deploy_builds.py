"""Deploy files that build and wire (issue 35 item 7); no container engine needed.

- Each Containerfile's build: a wheel built (``pip wheel --no-deps``) from exactly the files
  its ``COPY`` lines take, as its ``.dockerignore`` filters them, holds every package folder
  of the tree and the daemon's entry point. Regressions: ``launch`` and ``benchmarks``
  were mapped but not copied ("package directory 'launch' does not exist"); the hand-written
  package list lacked ``statetier.tiers.peer`` (setup.py now derives it from the tree).
- The DaemonSet's worker runs the image with the statetier connector, with the connector
  flags on the daemon's socket (as the sidecar's does). Regression: stock vLLM, no flags.
- Every Deployment, DaemonSet and ConfigMap name is defined once across the manifests (both
  files can be applied in one namespace). Regression: two ``inference-worker`` Deployments.
- One registry for statetier's images across docs, README and deploy/. Regression:
  ``registry.example/…`` in the docs, ``ghcr.io/example/…`` in the manifests.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from statetier.clients.vllm.layout import ConnectorConfig
from tests.support.deploy_files import (DEPLOY, REPO, containerfile_instructions, load_yaml_documents,
                                        package_folders, pod_specs)

CONTAINERFILES = ("Containerfile", "Containerfile.vllm")


def copied_sources(containerfile: Path) -> list[str]:
    """The repository paths the build context's COPY lines take (not ``--from`` a stage)."""
    sources: list[str] = []
    for word, arg in containerfile_instructions(containerfile):
        if word == "COPY" and "--from" not in arg:
            sources += arg.split()[:-1]
    return sources


def ignored(relative: str, patterns: list[str]) -> bool:
    """``.dockerignore`` semantics for what it holds here: the last matching line decides."""
    verdict = False
    for line in patterns:
        negated, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, pattern[3:]) for part in Path(relative).parts)
        else:
            hit = fnmatch.fnmatch(relative, pattern) or relative.startswith(pattern + "/")
        if hit:
            verdict = not negated
    return verdict


def build_context(containerfile: Path, into: Path) -> None:
    patterns = [line.strip() for line in (DEPLOY / f"{containerfile.name}.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for source in copied_sources(containerfile):
        path = REPO / source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            relative = file.relative_to(REPO).as_posix()
            assert not ignored(source, patterns), f"{containerfile.name} copies {source}, its .dockerignore drops it"
            if ignored(relative, patterns):
                continue
            (into / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, into / relative)


@pytest.mark.parametrize("name", CONTAINERFILES)
def test_the_wheel_builds_from_exactly_what_the_containerfile_copies(name: str, tmp_path: Path) -> None:
    context, out = tmp_path / "context", tmp_path / "wheels"
    context.mkdir()
    build_context(DEPLOY / name, context)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(out), str(context)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("statetier-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [p for p in package_folders() if f"{p.replace('.', '/')}/__init__.py" not in names] == []
    assert "statetier/daemon/__main__.py" in names


def workers() -> dict[str, dict]:
    """file name → the worker container of its inference Deployment."""
    found = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for _, spec in pod_specs(load_yaml_documents(path)):
            for container in spec["containers"]:
                if container["name"] == "worker":
                    found[path.name] = container
    return found


def test_the_daemonset_worker_runs_the_connector_image_with_its_flags() -> None:
    found = workers()
    assert set(found) == {"daemonset.yaml", "sidecar.yaml"}
    node, sidecar = found["daemonset.yaml"], found["sidecar.yaml"]
    assert node["image"] == sidecar["image"] and node["image"].rsplit(":", 1)[0].endswith("/vllm-openai-st")
    args = node["args"]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == ("StatetierConnector",
                                                                                 "statetier.clients.vllm")
    extra = ConnectorConfig.from_extra(transfer["kv_connector_extra_config"])
    socket = next(e["value"] for e in node["env"] if e["name"] == "STATETIER_URL")
    assert extra.url == socket == "unix:///run/statetier/statetier.sock"
    assert args[args.index("--block-size") + 1] == args[args.index("--max-num-batched-tokens") + 1]


def test_every_workload_and_config_map_name_is_defined_once() -> None:
    names: Counter = Counter()
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in load_yaml_documents(path):
            if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "ConfigMap"):
                names[(doc["kind"], doc["metadata"]["name"])] += 1
    assert names and [name for name, count in names.items() if count > 1] == []


def test_one_registry_names_statetiers_images_everywhere() -> None:
    image = re.compile(r"([\w.-]+(?:/[\w.-]+)*)/(statetier|vllm-openai-st):[\w.-]+")
    registries: dict[str, set[str]] = {}
    paths = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *DEPLOY.rglob("*")]
    for path in paths:
        if path.is_file() and path.suffix not in (".json", ".png"):
            for match in image.finditer(path.read_text(errors="replace")):
                registries.setdefault(match.group(1), set()).add(str(path.relative_to(REPO)))
    assert len(registries) == 1, registries
