"""Real ``redis-server`` processes on free loopback ports, for tests, benchmarks and examples (DESIGN §10).

- ``RedisServer``: one server in its own temp dir, no persistence unless asked.
  ``start`` / ``stop`` (SIGTERM, then SIGKILL) / ``kill`` (SIGKILL: a crash) /
  ``restart`` (same port, same dir) / ``close`` (stop and remove the dir);
  ``url``, ``port``, ``pid``, ``client()``, ``log_tail()``. A context manager: enter
  starts, exit closes.
- ``TlsFiles``: the PEM files of a TLS-only server (optionally requiring client certificates).

The binaries come from ``redis_binaries``, ports and stopping from ``processes``;
``redis_cluster.RedisCluster`` builds a cluster of these servers. ``tests/conftest.py``
wraps them as the ``redis_server``, ``redis_cluster`` and ``fresh_redis`` fixtures. Every
process started here is also stopped at interpreter exit, so a test run that dies early
leaves no server behind.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .processes import HOST, free_port, stop_process
from .redis_binaries import find_redis_binaries

_PORT_RETRIES = 3
_LOG_TAIL_LINES = 30

_live_servers: set[RedisServer] = set()  # strong refs: a dropped object is still killed at exit


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

    def client(self, **kwargs: Any) -> redis.Redis:
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

    def _connection_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"host": HOST, "port": self.port, "password": self.password}
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


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live_servers):
        server.kill()
