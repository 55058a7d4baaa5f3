"""The metrics HTTP endpoint: a tiny HTTP/1.1 server on the daemon's event loop (no threads).

``MetricsServer(metrics, host, port, ready)`` — ``await start()`` binds (``port=0`` picks a
free port, read it back from ``.port``); ``await close()`` stops listening and cancels
open connections. Routes, GET or HEAD — three separate answers (docs/operations.md §4.1):

- ``/metrics`` — ``prometheus_client.generate_latest(metrics.registry)``; the scrape-time
  collector reads tier stats here, on the loop, so it sees a consistent state.
- ``/livez`` (and ``/healthz``, the same) — liveness: 200 "ok" while the loop answers.
- ``/readyz`` — readiness: 200 while the daemon serves its socket (``ready()`` true, or a
  ``Readiness`` with ``serving``), else 503 (starting, draining). **Degraded is ready**: with
  Redis unreachable the daemon still serves its own copies, so ``/readyz`` stays 200 and its
  body starts ``degraded:`` and says what is served (``daemon.redis_watch``): a sidecar's pod
  is never taken out of its Service by a Redis outage.
- ``/readyz/strict`` — the front door's readiness: 503 when degraded too (for whatever routes
  PD work that needs Redis or the peers to daemons: routing away is right there).

One request per connection, then the connection closes. A request that is malformed,
too large or too slow gets a 4xx (or is dropped) and changes nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from statetier.protocol.errors import ConfigError

from .metrics import Metrics

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
MAX_HEADER_LINES = 64
LINGER_PAUSE_SECONDS = 0.1
LINGER_BYTES = 256 * 1024
_TEXT = "text/plain; charset=utf-8"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}


class _BadRequest(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Readiness:
    """What ``ready()`` may answer: serving (``/readyz``), degraded (``/readyz/strict``), why."""

    serving: bool
    degraded: bool = False
    body: str = ""

    @classmethod
    def of(cls, answer: "bool | Readiness") -> "Readiness":
        return answer if isinstance(answer, Readiness) else cls(bool(answer))

    def answer(self, strict: bool) -> tuple[int, bytes]:
        is_ready = self.serving and not (strict and self.degraded)
        body = self.body or ("ready\n" if self.serving and not self.degraded else "not ready\n")
        return (200 if is_ready else 503), body.encode()


class MetricsServer:
    def __init__(
        self,
        metrics: Metrics,
        host: str = "127.0.0.1",
        port: int = 9464,
        ready: Callable[[], bool | Readiness] = lambda: True,
        *,
        read_timeout: float = 10.0,
        max_connections: int = 64,
    ) -> None:
        self.metrics = metrics
        self.host = host
        self.requested_port = port
        self.ready = ready
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self._server: asyncio.base_events.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("MetricsServer.port is known only after start()")
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("MetricsServer already started")
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.requested_port,
                                                      limit=MAX_HEAD_BYTES)
        except OSError as exc:
            where = f"{self.host}:{self.requested_port}"
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"metrics.port: {where} is in use (another daemon? `ss -ltnp 'sport = "
                                  f":{self.requested_port}'` names it): stop it, or give this daemon another "
                                  f"port (metrics.port, --metrics-port; 0 picks a free one), or metrics.enabled "
                                  f"= false (--no-metrics)") from exc
            raise ConfigError(f"metrics.host/metrics.port: cannot listen on {where}: {exc}") from exc

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # asyncio runs each connection's handler as a task
        self._handlers.add(task)
        try:
            if len(self._handlers) > self.max_connections:
                return  # over the limit: close at once rather than queue
            try:
                method, path = await asyncio.wait_for(_read_request(reader), self.read_timeout)
            except _BadRequest as exc:
                writer.write(_response(400, f"bad request: {exc}\n".encode(), _TEXT))
                await writer.drain()
                await _discard_input(reader, writer)
            else:
                status, body, content_type = self._route(method, path)
                writer.write(_response(status, b"" if method == "HEAD" else body, content_type, len(body)))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass  # a slow or vanished client: just close
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    def _route(self, method: str, path: str) -> tuple[int, bytes, str]:
        if method not in ("GET", "HEAD"):
            return 405, b"only GET and HEAD\n", _TEXT
        if path == "/metrics":
            try:
                return 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST
            except Exception:
                log.exception("metrics: generating the exposition failed")
                return 500, b"metrics unavailable\n", _TEXT
        if path in ("/livez", "/healthz"):
            return 200, b"ok\n", _TEXT
        if path in ("/readyz", "/readyz/strict"):
            try:
                readiness = Readiness.of(self.ready())
            except Exception:
                log.exception("metrics: ready() raised")
                readiness = Readiness(False)
            status, body = readiness.answer(strict=path == "/readyz/strict")
            return status, body, _TEXT
        return 404, b"not found: try /metrics, /livez, /readyz, /readyz/strict\n", _TEXT


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The request line's method and path; the headers are read and ignored."""
    try:
        line = await reader.readline()
        if not line:
            raise asyncio.IncompleteReadError(b"", None)
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
            raise _BadRequest("expected 'METHOD /path HTTP/1.x'")
        for _ in range(MAX_HEADER_LINES):
            header = await reader.readline()
            if header in (b"\r\n", b"\n", b""):
                return parts[0].upper(), parts[1].split("?", 1)[0]
        raise _BadRequest("too many header lines")
    except (asyncio.LimitOverrunError, ValueError) as exc:  # a line past MAX_HEAD_BYTES
        raise _BadRequest("request head too large") from exc


async def _discard_input(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, then swallow what the client still sends (bounded), so that closing with
    unread input does not reset the connection before the client reads the 400."""
    if writer.can_write_eof():
        writer.write_eof()
    with contextlib.suppress(asyncio.TimeoutError):
        for _ in range(LINGER_BYTES // MAX_HEAD_BYTES):  # stops at EOF or a quiet pause
            if not await asyncio.wait_for(reader.read(MAX_HEAD_BYTES), LINGER_PAUSE_SECONDS):
                break


def _response(status: int, body: bytes, content_type: str, length: int | None = None) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
