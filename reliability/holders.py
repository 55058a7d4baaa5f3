"""Clients that hold leases and load-window regions, to be killed with SIGKILL (crash probe).

Run as a script (``python holders.py URL``) it is a small fork server: one process that
imported the frame transport once and forks a holder per line ``spawn REFS_JSON`` read on
stdin, printing ``<pid>`` once that holder holds what it should. A holder connects with
shared-memory windows, loads each ref into its load window (a region it never gives back)
and takes lookup leases it never releases, then sleeps until killed. Forking
costs a millisecond where a fresh interpreter costs a tenth of a second, so a run can kill
a thousand of them.

``HolderPool(url)`` is the parent side: ``spawn(refs)`` → pid, ``close()``.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time

HOLD_SECONDS = 60.0


async def _hold(url: str, refs: list[dict], model: str, ready_fd: int) -> None:
    from statetier.clients.transport import connect
    from statetier.protocol.frames import Op
    from statetier.protocol.identity import NamespaceSpec
    from statetier.protocol.messages import ref_from_wire
    from statetier.protocol.wire_meta import LoadMeta, LookupMeta, wire_ref

    namespace = NamespaceSpec(model_id=model).namespace().digest
    conn = await connect(url, shm=True)
    for ref in refs:  # each payload copied into our load window: a region we never give back
        await conn.request(Op.LOAD, LoadMeta(namespace, ref=wire_ref(ref_from_wire(ref)), shm=True))
    layers = tuple(ref["key"]["layer"] for ref in refs)  # leases we never release:
    await conn.request(Op.LOOKUP, LookupMeta(namespace, ((16, bytes.fromhex(refs[0]["key"]["prefix"])),), layers,
                                             kv_layout="prefix", lease=True))
    os.write(ready_fd, f"{os.getpid()}\n".encode())
    await asyncio.sleep(HOLD_SECONDS)


def serve(url: str, model: str) -> None:
    import statetier.clients.transport  # noqa: F401 - imported once, before any fork

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    out = sys.stdout.fileno()
    for line in sys.stdin:  # bounded by the parent: one line per holder
        if not line.startswith("spawn "):
            continue
        refs = json.loads(line[len("spawn "):])
        if os.fork() == 0:
            try:
                asyncio.run(_hold(url, refs, model, out))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent as a failed spawn
                os.write(out, f"error {type(exc).__name__}: {exc}\n".encode())
            os._exit(0)


class HolderPool:
    def __init__(self, url: str, model: str) -> None:
        self._proc = subprocess.Popen([sys.executable, __file__, url, model], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        self._buffer = b""

    def spawn_many(self, count: int, refs: list[dict], timeout: float = 30.0) -> list[int]:
        """Start ``count`` holders; their pids once every one holds (or failed: ``RuntimeError``)."""
        for _ in range(count):
            self._proc.stdin.write(("spawn " + json.dumps(refs) + "\n").encode())
        self._proc.stdin.flush()
        pids, deadline = [], time.monotonic() + timeout
        while len(pids) < count:
            line = self._read_line(deadline)
            if line.startswith("error"):
                raise RuntimeError(line)
            pids.append(int(line))
        return pids

    def _read_line(self, deadline: float) -> str:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError("a holder never got its leases")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the holder fork server exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().strip()

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.kill()
        self._proc.wait()
        self._proc.stdout.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
