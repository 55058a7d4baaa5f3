"""The processes around the SDK benchmark (``sdk.py``), and their CPU time.

- ``own_daemon(directory)`` — async context manager: a ``statetier.launch.DaemonProcess``
  on a fresh socket with the host tier only (url, pid); SIGTERM and cleanup afterwards.
- ``echo_server(directory)`` — async context manager: the raw round trip's far end, a uvloop
  ``Protocol`` echo server in a subprocess (``serve_echo(path)`` is its body); yields an
  ``EchoClient`` whose ``round_trip(message)`` sends and waits for the echo.
- ``process_cpu_seconds(pid)`` — user + system CPU of a process from ``/proc`` (or None).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from statetier.launch.daemons import DaemonProcess
from statetier.launch.processes import stop_process

DAEMON_ARENA_BYTES = 768 << 20
DAEMON_ARENA = f"{DAEMON_ARENA_BYTES >> 20}MiB"


@contextlib.asynccontextmanager
async def own_daemon(directory: Path):
    """``statetier serve`` on a fresh socket in ``directory``, host tier only (no disk, no
    metrics: nothing else competes for the cores); yields its ``DaemonProcess``."""
    daemon = DaemonProcess(name="bench", directory=directory, host_capacity=DAEMON_ARENA, metrics=False,
                           keyring=directory / "keyring.json", log_level="warning",
                           settings={"disk.enabled": "false"})
    await asyncio.to_thread(daemon.start)
    try:
        await _populated(daemon.pid, DAEMON_ARENA_BYTES)
        yield daemon
    finally:
        await asyncio.to_thread(daemon.close)


async def _populated(pid: int | None, arena_bytes: int, timeout: float = 20.0) -> None:
    """Until the daemon's arena is faulted in (``host.populate``: its shared-memory RSS, from
    /proc, reaches the arena's size), so that no row is measured beside the populating
    thread; at most ``timeout`` seconds (a kernel without MADV_POPULATE_WRITE never gets there)."""
    deadline = time.monotonic() + timeout
    while pid is not None and time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("RssShmem", "0 kB").split()[0]) * 1024 >= arena_bytes:
            return
        await asyncio.sleep(0.05)


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
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from statetier.benchmarks.procs import serve_echo; "
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
        if proc.stdin is not None:  # always: stdin=PIPE
            proc.stdin.close()
        stop_process(proc, 30)


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
