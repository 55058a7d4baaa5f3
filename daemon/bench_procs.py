"""The processes around the SDK benchmark (``daemon/bench_sdk.py``), and their CPU time.

- ``own_daemon(directory)`` — async context manager: ``statetier serve`` in a subprocess on a
  fresh socket with the host tier only; yields an ``OwnDaemon`` (url, pid, command) and
  stops it with SIGTERM afterwards.
- ``echo_server(directory)`` — async context manager: the raw round trip's far end, a uvloop
  ``Protocol`` echo server in a subprocess (``serve_echo(path)`` is its body); yields an
  ``EchoClient`` whose ``round_trip(message)`` sends and waits for the echo.
- ``process_cpu_seconds(pid)`` — user + system CPU of a process from ``/proc`` (or None).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DAEMON_ARENA = "768MiB"

@dataclass(frozen=True)
class OwnDaemon:
    url: str
    pid: int
    command: list[str]


@contextlib.asynccontextmanager
async def own_daemon(directory: Path):
    """``statetier serve`` on a fresh socket, host tier only; yields an ``OwnDaemon``."""
    socket_path = directory / "daemon.sock"
    command = [sys.executable, "-m", "statetier.daemon", "serve", "--socket", str(socket_path),
               "--disk-dir", str(directory / "disk"), "--keyring", str(directory / "keyring.json"),
               "--no-metrics", "--host-capacity", DAEMON_ARENA, "--set", "disk.enabled=false",
               "--log-level", "warning"]
    log_path = directory / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=directory, stdout=log, stderr=subprocess.STDOUT)
    url = f"unix://{socket_path}"
    try:
        await _wait_serving(proc, url, log_path)
        yield OwnDaemon(url, proc.pid, command)
    finally:
        _stop(proc)


async def _wait_serving(proc: subprocess.Popen, url: str, log_path: Path, timeout: float = 60.0) -> None:
    from statetier.clients import AsyncClient
    from statetier.protocol.errors import StatetierError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the benchmark daemon exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}")
        if os.path.exists(url.removeprefix("unix://")):
            try:
                async with AsyncClient(url, use_shm=False, timeout=2.0) as probe:
                    await probe.ping()
                return
            except (StatetierError, OSError):
                pass  # still starting
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the benchmark daemon did not serve {url} within {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_echo(path: str) -> None:
    """The raw round trip's far end: a uvloop Protocol echoing every byte; ends at stdin EOF."""
    import threading

    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
        server = await loop.create_unix_server(Echo, path)
        async with server:
            await stop.wait()

    uvloop.run(serve())


@contextlib.asynccontextmanager
async def echo_server(directory: Path):
    path = directory / "echo.sock"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from statetier.daemon.bench_procs import serve_echo; "
                             "serve_echo(sys.argv[1])", str(path)], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the echo server did not start")
            await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        transport, client = await loop.create_unix_connection(EchoClient, str(path))
        try:
            yield client
        finally:
            transport.close()
    finally:
        proc.stdin.close()
        _stop(proc)


class EchoClient(asyncio.Protocol):
    """The near end: send a message, wait until as many bytes came back."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._waiter: asyncio.Future | None = None
        self._missing = 0

    def data_received(self, data: bytes) -> None:
        self._missing -= len(data)
        if self._missing <= 0 and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def round_trip(self, message: bytes) -> None:
        self._missing = len(message)
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(message)
        await self._waiter


def process_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (10 ms resolution), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
