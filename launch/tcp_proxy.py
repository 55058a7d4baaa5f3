"""A TCP proxy over loopback that delays, holds, drops or corrupts what it forwards: a slow,
hung, flapping or bit-flipping network between a daemon and its Redis or its peers, without
touching either end (tests and reliability/).

- ``DelayProxy(target_port, delay=0.0)`` — ``start()`` listens on a free 127.0.0.1 port
  (``port``, ``url`` for a Redis URL), forwards every connection to ``target_port``, each
  chunk in either direction ``delay`` seconds late (set ``delay`` any time: it applies to
  the chunks that arrive after); ``hold()`` stops forwarding (bytes wait, connections stay
  open: what a frozen switch looks like), ``release()`` lets them go; ``close()`` ends every
  connection. ``connections`` counts the connections accepted, ``received`` the bytes read
  from clients (forwarded or still held). A context manager.
- ``drop()`` — every connection open now is cut (both ends see it closed), once; the
  listener stays: the next dial gets a fresh connection (an idle timeout, a middlebox or a
  NIC flap). ``dropped`` counts the connections cut.
- ``flip_next(offset)`` — the byte ``offset`` bytes into what the target sends next (to
  whichever client reads first) goes through with its low bit flipped, once: a corrupted
  transfer. ``flipped`` counts the bytes flipped.
- ``record()`` — from now on, what the target sends is also kept in ``recorded`` (what an
  eavesdropper on the wire would read), until ``close()``.

Threads, not the caller's event loop: the proxy keeps forwarding while the caller blocks.
"""

from __future__ import annotations

import socket
import threading
import time


class DelayProxy:
    def __init__(self, target_port: int, delay: float = 0.0, *, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.delay = delay
        self.connections = 0
        self._open = threading.Event()  # set: forwarding; clear: held
        self._open.set()
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._flip_at: int | None = None  # bytes from the target still to pass before the flip
        self.dropped = 0
        self.flipped = 0
        self.received = 0
        self.recorded: bytearray | None = None

    def start(self) -> "DelayProxy":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, name="delay-proxy", daemon=True).start()
        return self

    @property
    def port(self) -> int:
        assert self._listener is not None, "start() first"
        return int(self._listener.getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def drop(self) -> None:
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        self.dropped += len(sockets) // 2
        _cut(sockets)

    def flip_next(self, offset: int = 0) -> None:
        with self._lock:
            self._flip_at = offset

    def record(self) -> None:
        with self._lock:
            self.recorded = bytearray()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        if self._listener is not None:
            sockets.append(self._listener)
        _cut(sockets)

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5.0)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self.connections += 1
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst, from_target in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, from_target), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_target: bool) -> None:
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                with self._lock:
                    if not from_target:
                        self.received += len(chunk)
                    elif self.recorded is not None:
                        self.recorded += chunk
                if self.delay:
                    time.sleep(self.delay)
                self._open.wait()
                if self._closed.is_set():
                    break
                dst.sendall(self._maybe_flip(chunk) if from_target else chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _maybe_flip(self, chunk: bytes) -> bytes:
        with self._lock:
            at = self._flip_at
            if at is None:
                return chunk
            if at >= len(chunk):
                self._flip_at = at - len(chunk)
                return chunk
            self._flip_at = None
            self.flipped += 1
        flipped = bytearray(chunk)
        flipped[at] ^= 1
        return bytes(flipped)


def _cut(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
