"""The container file, the Kubernetes manifests and the systemd unit agree with the daemon.

No container engine or cluster here, so the checks are static but exact: the files parse,
and every path, port, probe, user and secret they name is the one the configuration they
ship makes the daemon use (``load_config`` on their own TOML and environment). The systemd
unit also passes ``systemd-analyze verify`` where systemd is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath

import pytest

from statetier.clients.vllm.layout import ConnectorConfig
from statetier.daemon.cli import build_parser
from statetier.daemon.cli.serve import config_overrides
from statetier.daemon.config import Config
from statetier.daemon.config_loading import load_config
from statetier.daemon.peer_address import DEFAULT_PORT
from tests.support.deploy_files import DEPLOY, REPO, containerfile_instructions, load_yaml_documents, pod_specs

CONTAINERFILE = DEPLOY / "Containerfile"
KUBE = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "statetier.service"
POD_IP = "10.0.0.7"  # what status.podIP stands for here
_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "": 1}


def final_stage() -> list[tuple[str, str]]:
    instructions = containerfile_instructions(CONTAINERFILE)
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def instruction(stage: list[tuple[str, str]], word: str) -> list[str]:
    return [arg for w, arg in stage if w == word]


def container_user() -> tuple[int, int]:
    (user,) = instruction(final_stage(), "USER")
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


def quantity(text: str | int) -> int:
    match = re.fullmatch(r"(\d+)([KMGT]i)?", str(text))
    assert match, f"unexpected quantity {text!r}"
    return int(match.group(1)) * _QUANTITY[match.group(2) or ""]


# -- the container file ------------------------------------------------------------------


def test_the_image_runs_as_a_non_root_user_it_creates() -> None:
    stage = final_stage()
    uid, gid = container_user()
    assert uid >= 1000 and gid >= 1000
    created = " ".join(instruction(stage, "RUN"))
    assert f"--uid {uid}" in created and f"--gid {gid}" in created


def test_the_image_exposes_and_health_checks_the_metrics_port_of_its_config() -> None:
    stage = final_stage()
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(instruction(stage, "ENV"))))
    shipped = dict(re.findall(r"(\S+)\s+(\S+)$", arg)[0] for arg in instruction(stage, "COPY") if "--from" not in arg)
    assert shipped["deploy/container/statetier.toml"] == env["STATETIER_CONFIG"]
    config = load_config(DEPLOY / "container" / "statetier.toml", env={})
    assert config.metrics.port == Config().metrics.port
    assert instruction(stage, "EXPOSE") == [f"{config.metrics.port} {DEFAULT_PORT}"]  # metrics, peers
    (health,) = instruction(stage, "HEALTHCHECK")
    assert f"http://127.0.0.1:{config.metrics.port}/healthz" in health
    assert config.metrics.host == "0.0.0.0"  # reachable by the health check and by probes
    assert json.loads(instruction(stage, "ENTRYPOINT")[0]) == ["statetier", "serve"]
    owned = " ".join(instruction(stage, "RUN"))
    for directory in (config.listen.socket_path.parent, config.disk.directory):
        assert re.search(rf"install -d -o statetier -g statetier -m \d+ .*{directory}\b", owned), directory


@pytest.mark.parametrize("name", ["Containerfile", "Containerfile.vllm"])
def test_the_images_install_the_wheel_built_from_the_repository(name: str) -> None:
    """Regression: ``pip install .``; the wheel file is what users get (issue 41)."""
    runs = " ".join(arg for word, arg in containerfile_instructions(DEPLOY / name) if word == "RUN")
    wheel_dir = re.search(r"pip wheel --no-deps --wheel-dir (\S+) \.", runs)
    assert wheel_dir, runs
    assert re.search(rf"pip install (--no-deps )?{re.escape(wheel_dir.group(1))}/statetier-\*\.whl", runs), runs
    assert "pip install ." not in runs and "-e ." not in runs


def test_the_image_installs_the_project_from_the_repository_with_a_torch_pyproject_allows() -> None:
    build = containerfile_instructions(CONTAINERFILE)
    runs = " ".join(arg for word, arg in build if word == "RUN")
    pins = set(re.findall(r'"(torch[^"]*)"', runs))
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert pins and pins <= {d for d in dependencies if d.startswith("torch")}
    sources = [arg.split()[:-1] for word, arg in build if word == "COPY" and "--from" not in arg]
    ignore = (DEPLOY / "Containerfile.dockerignore").read_text().splitlines()
    for paths in sources:
        for source in paths:
            assert (REPO / source).exists(), source
            assert f"!{source.rstrip('/')}/" in ignore or f"!{source}" in ignore \
                or any(f"!{source}".startswith(line) for line in ignore if line.startswith("!")), source


# -- Kubernetes --------------------------------------------------------------------------


def manifests() -> dict[str, list[dict]]:
    return {path.name: load_yaml_documents(path) for path in sorted(KUBE.glob("*.yaml"))}


def statetier_containers() -> list[tuple[str, dict, dict, list[dict]]]:
    """(file, pod spec, statetier container, the file's documents) for every workload running it."""
    found = []
    for name, documents in manifests().items():
        for _, spec in pod_specs(documents):
            for container in spec["containers"]:
                if container["name"] == "statetier":
                    found.append((name, spec, container, documents))
    return found


def config_of(container: dict, documents: list[dict], spec: dict, tmp_path: Path) -> Config:
    """The daemon's configuration in that container: its ConfigMap's TOML and its env."""
    env = {item["name"]: item.get("value") for item in container.get("env", [])}
    config_path = PurePosixPath(env.pop("STATETIER_CONFIG"))
    mount = next(m for m in container["volumeMounts"] if config_path.is_relative_to(m["mountPath"]))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    config_map = next(d for d in documents if d["kind"] == "ConfigMap"
                      and d["metadata"]["name"] == volume["configMap"]["name"])
    text = config_map["data"][str(config_path.relative_to(mount["mountPath"]))]
    (tmp_path / "statetier.toml").write_text(text)
    placeholders = {"redis-url": "rediss://statetier:secret@redis.test:6379/0"}
    for item in container.get("env", []):  # in order: $(NAME) expands a variable defined above it
        source = item.get("valueFrom", {})
        if "secretKeyRef" in source:
            env[item["name"]] = placeholders[source["secretKeyRef"]["key"]]
        elif "fieldRef" in source:
            env[item["name"]] = POD_IP if source["fieldRef"]["fieldPath"] == "status.podIP" else "node-or-pod-name"
        elif "$(" in item.get("value", ""):
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
    return load_config(tmp_path / "statetier.toml", env={k: v for k, v in env.items() if k.startswith("STATETIER_")})


def mount_of(container: dict, path: Path | PurePosixPath) -> dict:
    """The volume mount a path lies under (the deepest one)."""
    mounts = [m for m in container["volumeMounts"] if PurePosixPath(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of {container['name']}"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def volume(spec: dict, name: str) -> dict:
    return next(v for v in spec["volumes"] if v["name"] == name)


def same_storage(spec_a: dict, mount_a: dict, spec_b: dict, mount_b: dict) -> bool:
    a, b = volume(spec_a, mount_a["name"]), volume(spec_b, mount_b["name"])
    if spec_a is spec_b:
        return a is b and mount_a.get("subPath") == mount_b.get("subPath")
    return "hostPath" in a and "hostPath" in b and a["hostPath"]["path"] == b["hostPath"]["path"]


def test_every_manifest_parses_and_names_its_objects() -> None:
    found = manifests()
    assert {"sidecar.yaml", "daemonset.yaml", "secret.example.yaml", "podmonitor.yaml"} <= set(found)
    for name, documents in found.items():
        for doc in documents:
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], name
    kinds = {doc["kind"] for docs in found.values() for doc in docs}
    assert {"Deployment", "DaemonSet", "ConfigMap", "Secret", "PodMonitor"} <= kinds


def test_statetier_runs_in_a_sidecar_and_a_daemonset_from_the_same_image() -> None:
    running = statetier_containers()
    kinds = {(name, doc["kind"]) for name, _, _, docs in running for doc in docs if doc["kind"] in ("Deployment", "DaemonSet")}
    assert ("sidecar.yaml", "Deployment") in kinds and ("daemonset.yaml", "DaemonSet") in kinds
    images = {container["image"] for _, _, container, _ in running}
    assert len(images) == 1 and re.fullmatch(r"[\w./-]+/statetier:\d+\.\d+\.\d+", images.pop())


def test_probes_and_ports_match_the_configured_metrics_endpoint(tmp_path: Path) -> None:
    for name, spec, container, documents in statetier_containers():
        config = config_of(container, documents, spec, tmp_path)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        peer_port = int(config.peers.listen.rpartition(":")[2])
        assert ports == {"metrics": config.metrics.port, "peers": peer_port}, name
        assert config.peers.enabled and config.peers.advertise == f"{POD_IP}:{peer_port}", name
        assert config.metrics.host == "0.0.0.0", f"{name}: kubelet probes come from outside the pod"
        probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert {kind: probe["path"] for kind, probe in probes.items()} == {
            "startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}, name
        assert all(ports.get(probe["port"], probe["port"]) == config.metrics.port for probe in probes.values())


def test_secrets_carry_the_redis_url_and_the_keyring(tmp_path: Path) -> None:
    (secret,) = [d for d in manifests()["secret.example.yaml"] if d["kind"] == "Secret"]
    for name, spec, container, documents in statetier_containers():
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        assert refs["STATETIER_REDIS__URL"] == {"name": secret["metadata"]["name"], "key": "redis-url"}, name
        config = config_of(container, documents, spec, tmp_path)
        assert config.redis.url is not None
        mount = mount_of(container, config.keyring_path())
        keys = volume(spec, mount["name"])["secret"]
        assert keys["secretName"] == secret["metadata"]["name"]
        assert {i["key"] for i in keys["items"]} <= set(secret["stringData"])
        assert str(PurePosixPath(mount["mountPath"]) / keys["items"][0]["path"]) == str(config.keyring_path())


def test_workers_share_the_socket_volume_with_statetier_and_nothing_else(tmp_path: Path) -> None:
    for name, spec, container, documents in statetier_containers():
        config = config_of(container, documents, spec, tmp_path)
        assert config.host.shm_dir is None, name  # the arena is a memfd: no file anyone could open
        workers = [(s, c) for _, s in pod_specs(documents) for c in s["containers"] if c["name"] != "statetier"]
        assert workers, f"{name}: no worker to share the socket with"
        socket_mount = mount_of(container, config.listen.socket_path)
        for worker_spec, worker in workers:
            assert {"name": "STATETIER_URL", "value": f"unix://{config.listen.socket_path}"} in worker["env"]
            theirs = mount_of(worker, socket_mount["mountPath"])
            assert same_storage(spec, socket_mount, worker_spec, theirs), f"{name}: {socket_mount['mountPath']}"
            shared = [m["mountPath"] for m in container["volumeMounts"]
                      for t in worker.get("volumeMounts", []) if same_storage(spec, m, worker_spec, t)]
            assert shared == [socket_mount["mountPath"]], f"{name}: workers also see {shared}"
        disk = volume(spec, mount_of(container, config.disk.directory)["name"])
        assert "hostPath" in disk or "persistentVolumeClaim" in disk, name


def test_the_statetier_containers_memory_limit_holds_the_host_tiers_arena(tmp_path: Path) -> None:
    for name, spec, container, documents in statetier_containers():
        config = config_of(container, documents, spec, tmp_path)
        assert quantity(container["resources"]["limits"]["memory"]) > config.host.capacity_bytes, name


def test_peers_get_through_the_socket_check(tmp_path: Path) -> None:
    uid, gid = container_user()
    for name, spec, container, documents in statetier_containers():
        config = config_of(container, documents, spec, tmp_path)
        context = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
        assert context["runAsNonRoot"] is True and (context["runAsUser"], context["runAsGroup"]) == (uid, gid), name
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        workers = [(s, c) for _, s in pod_specs(documents) for c in s["containers"] if c["name"] != "statetier"]
        for worker_spec, worker_container in workers:
            worker = {**worker_spec.get("securityContext", {}), **worker_container.get("securityContext", {})}
            worker_uid, worker_gid = worker["runAsUser"], worker["runAsGroup"]
            assert config.is_unix_peer_allowed(worker_uid, worker_gid, own_uid=uid), name
            assert worker_gid == gid or gid in worker.get("supplementalGroups", []), \
                f"{name}: the worker cannot open the 0660 socket and arena"


def test_the_sidecar_worker_is_vllm_with_the_statetier_connector_on_the_daemons_socket(tmp_path: Path) -> None:
    """Regression: the worker was the stock vLLM image with no --kv-transfer-config, so
    nothing ever talked to the daemon beside it."""
    (spec, container, documents) = next((s, c, d) for n, s, c, d in statetier_containers() if n == "sidecar.yaml")
    config = config_of(container, documents, spec, tmp_path)
    (worker,) = [c for c in spec["containers"] if c["name"] != "statetier"]
    args = worker["args"]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == ("StatetierConnector",
                                                                                 "statetier.clients.vllm")
    extra = ConnectorConfig.from_extra(transfer["kv_connector_extra_config"])  # the keys the connector knows
    assert extra.url == f"unix://{config.listen.socket_path}" and config.redis.url is not None
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert args[args.index("--block-size") + 1] == args[args.index("--max-num-batched-tokens") + 1]
    built = (DEPLOY / "Containerfile.vllm").read_text()
    assert worker["image"].rsplit(":", 1)[0].endswith("/vllm-openai-st") and "ARG VLLM_IMAGE=vllm/vllm-openai:" in built
    assert '"torch==${TORCH}"' in built  # the engine's torch is a constraint: never replaced


def test_scrape_annotations_and_the_pod_monitor_find_the_metrics_port() -> None:
    (monitor,) = [d for d in manifests()["podmonitor.yaml"] if d["kind"] == "PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (selector,) = monitor["spec"]["selector"]["matchExpressions"]
    for name, spec, container, documents in statetier_containers():
        workload = next(d for d in documents if d["kind"] in ("Deployment", "DaemonSet")
                        and d["spec"]["template"]["spec"] is spec)
        template = workload["spec"]["template"]["metadata"]
        assert template["labels"][selector["key"]] in selector["values"], name
        port = next(p for p in container["ports"] if p["name"] == endpoint["port"])
        assert template["annotations"]["prometheus.io/port"] == str(port["containerPort"])
        assert template["annotations"]["prometheus.io/path"] == endpoint["path"] == "/metrics"


# -- systemd -----------------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_the_unit_runs_the_example_config_as_its_own_user() -> None:
    unit = unit_settings()
    (exec_start,) = unit["ExecStart"]
    program, *argv = exec_start.split()
    assert program.endswith("/bin/statetier") and argv[0] == "serve"
    args = build_parser().parse_args(argv)
    assert args.config == Path("/etc/statetier/statetier.toml")
    config = load_config(DEPLOY / "statetier.toml", env={}, overrides=config_overrides(args))
    assert unit["User"] == ["statetier"] and unit["Group"] == ["statetier"]
    assert unit["Restart"] == ["on-failure"]
    assert "ExecReload" not in unit  # settings are read once: reload is refused, not half-applied
    assert config.listen.socket_path.parent == Path("/run") / unit["RuntimeDirectory"][0]
    assert config.disk.directory == Path("/var/lib") / unit["StateDirectory"][0]
    assert int(unit["TimeoutStopSec"][0].rstrip("s")) > config.limits.shutdown_grace_seconds
    assert {"LimitNOFILE", "LimitMEMLOCK", "TasksMax"} <= set(unit)
    sysusers = (DEPLOY / "systemd" / "statetier.sysusers.conf").read_text()
    assert re.search(r"^u statetier - .* /var/lib/statetier ", sysusers, re.M)
    tmpfiles = (DEPLOY / "systemd" / "statetier.tmpfiles.conf").read_text()
    socket_dir = re.search(rf"^d\s+{config.listen.socket_path.parent}\s+(\d+)\s+statetier\s+statetier", tmpfiles, re.M)
    assert socket_dir and socket_dir.group(1) == unit["RuntimeDirectoryMode"][0]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart exists: point it at this checkout's statetier.
    statetier = Path(sys.executable).with_name("statetier")
    assert statetier.exists(), "the project is not installed in this interpreter's environment"
    unit = tmp_path / "statetier.service"
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={statetier}", UNIT.read_text(), flags=re.M))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if "statetier.service" in line]
    assert result.returncode == 0 and complaints == [], result.stdout + result.stderr
