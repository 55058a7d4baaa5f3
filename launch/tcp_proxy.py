"""A TCP proxy over loopback that delays (or holds) what it forwards: a slow or hung network
between a daemon and its Redis, without touching either (tests and reliability/).

- ``DelayProxy(target_port, delay=0.0)`` — ``start()`` listens on a free 127.0.0.1 port
  (``port``, ``url`` for a Redis URL), forwards every connection to ``target_port``, each
  chunk in either direction ``delay`` seconds late (set ``delay`` any time: it applies to
  the chunks that arrive after); ``hold()`` stops forwarding (bytes wait, connections stay
  open: what a frozen switch looks like), ``release()`` lets them go; ``close()`` ends every
  connection. ``connections`` counts the connections accepted. A context manager.

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

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        if self._listener is not None:
            sockets.append(self._listener)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

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
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                if self.delay:
                    time.sleep(self.delay)
                self._open.wait()
                if self._closed.is_set():
                    break
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
