"""A Redis Cluster of real ``redis-server`` processes, for tests, benchmarks and probes.

- ``RedisCluster``: three masters (``masters=``) on free ports covering all 16384 slots;
  ``startup_nodes``, ``url``, ``nodes`` (each a ``RedisServer``); ``start`` / ``stop`` /
  ``close``; a context manager. Created with ``redis-cli --cluster create``, or with
  CLUSTER ADDSLOTSRANGE / MEET when no cli was found.
- ``free_cluster_port()``: a free port whose cluster bus port (port + 10000) is free too.
- ``cluster_node_args(port)``: the ``redis-server`` arguments of one cluster node.

``tests/conftest.py`` wraps it as the ``redis_cluster`` fixture; the reliability probes
start nodes with ``cluster_node_args`` themselves.
"""

from __future__ import annotations

import random
import subprocess
import time

from .processes import HOST, is_port_free
from .redis_binaries import find_redis_binaries
from .redis_servers import RedisServer

CLUSTER_SLOTS = 16384
_CLUSTER_BUS_OFFSET = 10000
_CLUSTER_PORT_MIN, _CLUSTER_PORT_MAX = 12000, 22000


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too.

    Both sit below Linux's ephemeral range (32768+), so no outgoing connection takes
    them between this check and the server's bind.
    """
    for _ in range(200):
        port = random.randint(_CLUSTER_PORT_MIN, _CLUSTER_PORT_MAX)
        if is_port_free(port) and is_port_free(port + _CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free cluster port pair found on 127.0.0.1")



class RedisCluster:
    """Three cluster-enabled masters on free ports, all 16384 slots assigned."""

    def __init__(self, *, masters: int = 3, ready_timeout_s: float = 30.0) -> None:
        self._masters = masters
        self._ready_timeout_s = ready_timeout_s
        self.nodes: list[RedisServer] = []

    def start(self) -> RedisCluster:
        if self.nodes:
            raise RuntimeError("cluster already started")
        try:
            for _ in range(self._masters):
                node = RedisServer()
                self.nodes.append(node)  # before start, so close() removes its dir on failure
                port = free_cluster_port()
                node.start(port, cluster_node_args(port))
            self._create()
            self._wait_until_ok()
        except BaseException:
            self.close()
            raise
        return self

    def stop(self) -> None:
        """Stop every node by pid (their dirs stay until ``close``)."""
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.nodes = []

    def __enter__(self) -> RedisCluster:
        if not self.nodes:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every master, for ``ClusterNode(host, port)``."""
        return [(HOST, node.port) for node in self.nodes]

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.nodes[0].port}"

    def _create(self) -> None:
        _, cli = find_redis_binaries()
        if cli is None:
            self._create_with_commands()
            return
        argv = [cli, "--cluster", "create", *(f"{HOST}:{n.port}" for n in self.nodes)]
        argv += ["--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({done.returncode}):\n"
                f"{done.stdout.decode(errors='replace')}{done.stderr.decode(errors='replace')}"
            )

    def _create_with_commands(self) -> None:
        """Without a cli: split the slots evenly, then MEET every node from the first."""
        per_node = CLUSTER_SLOTS // len(self.nodes)
        for index, node in enumerate(self.nodes):
            first = index * per_node
            last = CLUSTER_SLOTS - 1 if index == len(self.nodes) - 1 else first + per_node - 1
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        with self.nodes[0].client() as client:
            for node in self.nodes[1:]:
                client.execute_command("CLUSTER", "MEET", HOST, node.port)

    def _wait_until_ok(self) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        want = {
            "cluster_state": "ok",
            "cluster_slots_assigned": str(CLUSTER_SLOTS),
            "cluster_known_nodes": str(len(self.nodes)),
        }
        while True:
            infos = [_cluster_info(node) for node in self.nodes]
            if all(all(info.get(k) == v for k, v in want.items()) for info in infos):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {self._ready_timeout_s}s: {infos}")
            time.sleep(0.1)


def cluster_node_args(port: int) -> list[str]:
    return [
        "--cluster-enabled", "yes",
        "--cluster-config-file", f"nodes-{port}.conf",
        "--cluster-node-timeout", "2000",
    ]


def _cluster_info(node: RedisServer) -> dict[str, str]:
    with node.client(decode_responses=True) as client:
        text = client.execute_command("CLUSTER", "INFO")  # raw: no reply callback for "CLUSTER"
    pairs = (line.split(":", 1) for line in str(text).splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}

