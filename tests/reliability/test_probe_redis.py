"""The Redis fault probe's own wiring (``reliability/probe_redis.py``), without a chaos run:

- it is one of ``run.py``'s probes (so ``make chaos`` and ``make chaos-short`` run it), with
  a share of the run, and its short form still injects every fault once;
- the delaying proxy it goes through forwards a real redis-server's replies, late by its
  delay, and a held proxy forwards nothing until released (counted in round trips: a PING
  answered or not within a bounded wait, no timing threshold).
"""

from __future__ import annotations

import socket

import probe_redis
import run
from harness import Budget

from statetier.launch.tcp_proxy import DelayProxy


def test_the_probe_runs_in_chaos_and_chaos_short_with_every_fault() -> None:
    assert run.PROBES["redis"] is probe_redis and run.SHARES["redis"] > 0
    assert Budget(60, short=True).scale(50, 1) == 1  # one cycle of …
    assert set(probe_redis.FAULTS) == {"kill_keep_data", "kill_lose_data", "sigstop", "proxy_held"}  # … all four


def ping(port: int, timeout: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64)


def test_the_proxy_forwards_late_and_holds(redis_server) -> None:
    with DelayProxy(redis_server.port, delay=0.05) as proxy:
        assert ping(proxy.port, timeout=30) == b"+PONG\r\n"
        proxy.hold()
        try:
            ping(proxy.port, timeout=1.0)
            raise AssertionError("a held proxy forwarded a reply")
        except TimeoutError:
            pass
        proxy.release()
        assert ping(proxy.port, timeout=30) == b"+PONG\r\n"
        assert proxy.connections == 3
