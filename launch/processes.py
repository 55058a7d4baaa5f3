"""Local child processes: a loopback port to give one, and how one is stopped.

- ``HOST``: 127.0.0.1, where every server started from ``statetier.launch`` listens.
- ``free_port()``: a TCP port free on ``HOST`` right now.
- ``is_port_free(port)``: whether ``port`` can be bound on ``HOST`` right now.
- ``stop_process(proc, timeout_s)``: SIGTERM, then SIGKILL after ``timeout_s``; reaped.

Used by ``redis_servers`` and ``redis_cluster``, the benchmarks' echo peer, the tests'
Prometheus and the reliability probes.
"""

from __future__ import annotations

import signal
import socket
import subprocess

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port that nothing listens on at 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]



def is_port_free(port: int) -> bool:
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
