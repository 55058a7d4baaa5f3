"""The deploy files agree with each other and with the docs (issue 41 item 7).

- One full reference per image (registry, name, tag) in the Containerfiles' headers, the
  manifests, README and docs; statetier's tag is the project's version. Regression: the
  Containerfile's header built ``statetier:0.1.0``, everything else pulled
  ``ghcr.io/example/statetier:0.1.0``.
- What docs/operations.md §4 names is in the manifests: every volume it calls one (with its
  ``sizeLimit`` where it says so), every absolute path (or a route the daemon serves).
  Regression: §4 sized a ``dshm`` volume no manifest has.
- Every manifest running statetier enables ``[peers]`` on the port it declares as the
  container's ``peers`` port, the default one (test_manifests checks the advertised pod IP).
- README's layout table names every package folder of the tree that holds a tier.
"""

from __future__ import annotations

import re
import tomllib

from statetier.daemon.peer_address import DEFAULT_PORT
from tests.support.deploy_files import DEPLOY, REPO, load_yaml_documents, pod_specs

IMAGE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*(statetier|vllm-openai-st)):(\d[\w.-]*)")
ROUTES = {"/metrics", "/livez", "/healthz", "/readyz", "/readyz/strict"}


def texts() -> dict[str, str]:
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(DEPLOY.rglob("*"))]
    return {str(p.relative_to(REPO)): p.read_text(errors="replace") for p in paths
            if p.is_file() and p.suffix not in (".json", ".png") and p.name != "benchmarks.md"}


def operations_section(number: int) -> str:
    text = (REPO / "docs" / "operations.md").read_text()
    return text.split(f"\n## {number}.", 1)[1].split("\n## ", 1)[0]


def kubernetes_text() -> str:
    return "\n".join(p.read_text() for p in sorted((DEPLOY / "kubernetes").glob("*.yaml")))


def volumes() -> dict[str, dict]:
    found = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for _, spec in pod_specs(load_yaml_documents(path)):
            found.update({v["name"]: v for v in spec.get("volumes", [])})
    return found


def test_each_image_has_one_full_reference_everywhere() -> None:
    references: dict[str, set[tuple[str, str]]] = {}
    for name, text in texts().items():
        for match in IMAGE.finditer(text):
            references.setdefault(match.group(2), set()).add((match.group(0), name))
    assert set(references) == {"statetier", "vllm-openai-st"}
    for image, found in references.items():
        assert len({ref for ref, _ in found}) == 1, f"{image}: {sorted(found)}"
        (ref,) = {ref for ref, _ in found}
        assert "/" in ref, f"{ref}: no registry"
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    (statetier,) = {ref for ref, _ in references["statetier"]}
    assert statetier.endswith(f"/statetier:{version}")
    header = (DEPLOY / "Containerfile").read_text().split("\nARG ", 1)[0]
    assert f"-t {statetier} ." in header


def test_the_volumes_and_paths_operations_names_are_in_the_manifests() -> None:
    section, manifests, defined = operations_section(4), kubernetes_text(), volumes()
    claimed = set(re.findall(r"`([a-z0-9-]+)` (?:`sizeLimit`|volume|`emptyDir`|`hostPath`)", section))
    assert claimed <= set(defined), claimed - set(defined)
    for name in re.findall(r"`([a-z0-9-]+)` `sizeLimit`", section):
        assert "sizeLimit" in defined[name].get("emptyDir", {}), name
    paths = set(re.findall(r"`(/[\w./-]+)`", section))
    assert paths, "operations.md §4 names no path"
    for path in paths - ROUTES:
        if path == "/dev/shm":
            assert "/dev/shm" not in manifests  # the arena is a memfd: the docs say there is no such volume
        else:
            assert path in manifests, f"operations.md §4 names {path}, no manifest has it"


def test_every_statetier_container_enables_peers_on_the_port_it_declares() -> None:
    found = 0
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        documents = load_yaml_documents(path)
        for _, spec in pod_specs(documents):
            for container in spec["containers"]:
                if container["name"] != "statetier":
                    continue
                found += 1
                mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/statetier")
                volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
                config_map = next(d for d in documents if d["kind"] == "ConfigMap"
                                  and d["metadata"]["name"] == volume["configMap"]["name"])
                peers = tomllib.loads(config_map["data"]["statetier.toml"])["peers"]
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                assert peers["enabled"] is True and peers["listen"] == f"0.0.0.0:{ports['peers']}", path.name
                assert ports["peers"] == DEFAULT_PORT, path.name
    assert found == 2


def test_readmes_layout_table_names_every_tier_package() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Layout", 1)[1].split("\n\n", 2)[1]
    tiers = sorted(p.parent.name for p in (REPO / "tiers").glob("*/__init__.py"))
    assert "peer" in tiers
    for tier in tiers:
        assert f"`tiers/{tier}/`" in table or f"`{tier}/`" in table, f"README's layout table lacks tiers/{tier}/"
