"""The daemon's listeners: a Unix socket (always) and TCP, optionally with TLS (DESIGN §7).

``Server(engine: EngineCalls, config, metrics=None)`` (``NullMetrics`` when None: no part checks
for None) — two awaited phases around the app's serving:

- ``await start()``         listen. A stale socket file is removed only when nothing
                            answers on it (a live daemon there is a ``ConfigError``); the
                            socket gets ``listen.socket_mode`` before it accepts anyone.
- ``await shutdown(grace)`` stop accepting, let in-flight requests finish within ``grace``
                            seconds (default ``limits.shutdown_grace_seconds``), cancel the
                            rest, say GOODBYE and close every connection (each one's leases
                            released through ``engine.release_owner``),
                            remove the socket file. Idempotent.

``stats()`` → ``{"connections", "inflight_requests", "connections_reading_paused", "window_regions",
"budget_bytes_in_use", "budget_bytes_limit", "budget_waiters"}``, read by STATS and the
metrics collector.
``socket_path`` and ``tcp_address`` (host, port; port 0 in the config = ephemeral) say
where it listens once started. Per-connection behaviour lives in ``connection.py``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import ssl
import stat

from statetier.daemon.server.auth import TenantDirectory, server_ssl_context
from statetier.daemon.server.budget import ByteBudget
from statetier.daemon.config_values import split_host_port
from statetier.daemon.metrics import Metrics, NullMetrics
from statetier.daemon.server.connection import SOCKET_BUFFER_BYTES, Connection, ConnectionContext
from statetier.daemon.server.engine_calls import EngineCalls
from statetier.protocol.errors import ConfigError

log = logging.getLogger(__name__)

_BACKLOG = 512
_CLOSE_WAIT_SECONDS = 2.0  # after GOODBYE+close, before aborting a peer that does not read


class Server:
    """The listeners and the connections of one daemon; see the module docstring."""

    def __init__(self, engine: EngineCalls, config, metrics: Metrics | NullMetrics | None = None) -> None:
        self._engine = engine
        self._config = config
        self._metrics = NullMetrics() if metrics is None else metrics
        limits = config.limits
        self.budget = ByteBudget(limits.byte_budget, limits.busy_wait_seconds, self._metrics)
        self._tenants = TenantDirectory(config.tenants)
        self._connections: set[Connection] = set()
        self._listeners: list[asyncio.AbstractServer] = []
        self._socket_inode: tuple[int, int] | None = None
        self._shut_down = False
        self.socket_path: str | None = None
        self.tcp_address: tuple[str, int] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        listen = self._config.listen
        try:
            if listen.socket_path:
                await self._listen_unix(str(listen.socket_path), _socket_mode(listen.socket_mode))
            if listen.tcp:
                await self._listen_tcp(listen.tcp)
        except BaseException:
            await self._close_listeners()
            raise

    async def shutdown(self, grace: float | None = None) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        if grace is None:
            grace = self._config.limits.shutdown_grace_seconds
        for listener in self._listeners:
            listener.close()
        connections = list(self._connections)
        for conn in connections:
            conn.stop_accepting()
        running = [task for conn in connections for task in conn.request_tasks]
        if running:
            _, late = await asyncio.wait(running, timeout=grace)
            if late:
                log.warning("shutdown: cancelling %d requests still running after %ss", len(late), grace)
        connections = list(self._connections)  # one accepted as the listener closed, too
        for conn in connections:
            conn.close("shutdown")
        await self._await_closed(connections)
        await self._close_listeners()

    async def _await_closed(self, connections: list[Connection]) -> None:
        closing = [conn.closed for conn in connections if conn.closed is not None]
        if not closing:
            return
        _, stuck = await asyncio.wait(closing, timeout=_CLOSE_WAIT_SECONDS)
        if stuck:
            for conn in connections:
                if conn.closed is not None and not conn.closed.done():
                    conn.abort()
            await asyncio.wait(closing)

    async def _close_listeners(self) -> None:
        for listener in self._listeners:
            listener.close()
        for listener in self._listeners:
            await listener.wait_closed()
        self._listeners.clear()
        self._remove_socket_file()

    # -- listening ---------------------------------------------------------------------

    async def _listen_unix(self, path: str, mode: int) -> None:
        await _remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.bind(path)
            info = os.stat(path)
            self._socket_inode = (info.st_dev, info.st_ino)
            os.chmod(path, mode)  # before listen(): nobody connects under the umask's mode
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot bind listen.socket_path {path!r}: {exc}") from exc
        self.socket_path = path
        context = self._context(is_unix=True)
        try:
            listener = await asyncio.get_running_loop().create_unix_server(
                lambda: Connection(context), sock=sock, backlog=_BACKLOG
            )
        except BaseException:
            sock.close()
            raise
        self._listeners.append(listener)

    async def _listen_tcp(self, address: str) -> None:
        try:
            host, port = split_host_port(address)
        except ValueError as exc:
            raise ConfigError(f"listen.tcp: {exc}") from exc
        listen = self._config.listen
        ssl_context = server_ssl_context(listen, self._refused_handshake)
        if ssl_context is None:
            log.warning("listening on TCP %s without TLS: tokens travel in clear text", address)
        context = self._context(is_unix=False)
        try:
            listener = await asyncio.get_running_loop().create_server(
                lambda: Connection(context),
                host, port, ssl=ssl_context, backlog=_BACKLOG, reuse_address=True,
            )
        except OSError as exc:
            fix = (": another process holds that port; stop it, or set listen.tcp to a free port"
                   if exc.errno == errno.EADDRINUSE else "")
            raise ConfigError(f"cannot listen on listen.tcp {address!r}: {exc}{fix}") from exc
        self._listeners.append(listener)
        bound = listener.sockets[0].getsockname()
        self.tcp_address = (bound[0], bound[1])

    def _refused_handshake(self, exc: ssl.SSLError) -> None:
        log.warning("connection refused: TLS handshake failed: %s", getattr(exc, "reason", None) or exc)
        self._metrics.count_auth_failure("tls")

    def _context(self, *, is_unix: bool) -> ConnectionContext:
        limits = self._config.limits
        return ConnectionContext(
            engine=self._engine,
            tenants=self._tenants,
            budget=self.budget,
            listen=self._config.listen,
            max_frame=limits.max_frame_bytes,
            max_inflight=limits.max_inflight_per_connection,
            metrics=self._metrics,
            is_unix=is_unix,
            daemon_stats=self.stats,
            window_bytes=self._config.host.window_bytes if is_unix else 0,
            on_open=self._connections.add,
            on_close=self._connections.discard,
        )

    def _remove_socket_file(self) -> None:
        if self.socket_path is None or self._socket_inode is None:
            return
        try:
            info = os.stat(self.socket_path)
            if (info.st_dev, info.st_ino) == self._socket_inode:  # still ours
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        self._socket_inode = None

    # -- observation -------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "connections": len(self._connections),
            "inflight_requests": sum(conn.inflight for conn in self._connections),
            "connections_reading_paused": sum(conn.is_reading_paused for conn in self._connections),
            "window_regions": sum(conn.window_regions for conn in self._connections),
            "budget_bytes_in_use": self.budget.in_use,
            "budget_bytes_limit": self.budget.limit,
            "budget_waiters": self.budget.waiting,
        }


async def _remove_stale_socket(path: str) -> None:
    """Unlink a socket file nobody listens on; refuse a live one or a non-socket file."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ConfigError(f"listen.socket_path {path!r} exists and is not a socket")
    try:
        _, writer = await asyncio.open_unix_connection(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    except OSError as exc:
        raise ConfigError(f"cannot probe listen.socket_path {path!r}: {exc}") from exc
    writer.close()
    await writer.wait_closed()
    raise ConfigError(f"another process is listening on listen.socket_path {path!r}: stop it, or give this "
                      f"daemon its own socket (listen.socket_path, --socket)")


def _socket_mode(mode) -> int:
    if isinstance(mode, str):
        return int(mode, 8)
    return int(mode)
