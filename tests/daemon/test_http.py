"""MetricsServer: a real socket on an ephemeral port, raw asyncio clients and urllib in a thread."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from statetier.daemon.http import MetricsServer, Readiness
from statetier.daemon.metrics import Metrics
from statetier.tiers.base import TierStats


class Flag:
    def __init__(self) -> None:
        self.is_set = False

    def __call__(self) -> bool:
        return self.is_set


@pytest.fixture
async def served() -> AsyncIterator[tuple[MetricsServer, Metrics, Flag]]:
    metrics = Metrics()
    ready = Flag()
    server = MetricsServer(metrics, "127.0.0.1", 0, ready, read_timeout=2.0)
    await server.start()
    try:
        yield server, metrics, ready
    finally:
        await server.close()


async def raw_request(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as is; read until the server closes; parse status, headers, body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, body


def get(port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()


async def test_metrics_endpoint_serves_the_registry(served) -> None:
    server, metrics, _ = served
    metrics.count_busy()
    metrics.track(lambda: [TierStats("host", 2, 512, 4096, 0, 0)], lambda: {"connections": 1})
    status, headers, body = await raw_request(server.port, get(server.port, "/metrics"))
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=")
    assert headers["Connection"] == "close"
    assert int(headers["Content-Length"]) == len(body)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples[("statetier_busy_total", ())] == 1
    assert samples[("statetier_tier_used_bytes", (("tier", "host"),))] == 512
    assert samples[("statetier_connections", ())] == 1


async def test_healthz_and_readyz_flip(served) -> None:
    server, _, ready = served
    assert await raw_request(server.port, get(server.port, "/healthz")) == (
        200, {"Content-Type": "text/plain; charset=utf-8", "Content-Length": "3", "Cache-Control": "no-store",
              "Connection": "close"}, b"ok\n",
    )
    status, _, body = await raw_request(server.port, get(server.port, "/readyz"))
    assert (status, body) == (503, b"not ready\n")
    ready.is_set = True
    status, _, body = await raw_request(server.port, get(server.port, "/readyz?verbose=1"))
    assert (status, body) == (200, b"ready\n")


async def test_liveness_readiness_and_degradation_are_three_answers() -> None:
    """Degraded is ready: /readyz 200 with the degraded body, /readyz/strict 503 (issue 41)."""
    answer = Readiness(False)
    server = MetricsServer(Metrics(), "127.0.0.1", 0, lambda: answer, read_timeout=2.0)
    await server.start()
    try:
        async def statuses() -> tuple[int, int, int, int]:
            found = [await raw_request(server.port, get(server.port, path))
                     for path in ("/livez", "/healthz", "/readyz", "/readyz/strict")]
            return tuple(status for status, _, _ in found)  # type: ignore[return-value]

        assert await statuses() == (200, 200, 503, 503)  # starting or draining
        answer = Readiness(True)
        assert await statuses() == (200, 200, 200, 200)
        answer = Readiness(True, degraded=True, body="degraded: redis unreachable\n")
        assert await statuses() == (200, 200, 200, 503)
        for path in ("/readyz", "/readyz/strict"):
            assert (await raw_request(server.port, get(server.port, path)))[2] == b"degraded: redis unreachable\n"
    finally:
        await server.close()


async def test_urllib_client_in_a_thread(served) -> None:
    server, metrics, ready = served
    metrics.count_error("capacity")
    base = f"http://127.0.0.1:{server.port}"

    def fetch(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(base + path, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    status, body = await asyncio.to_thread(fetch, "/metrics")
    assert status == 200 and b'statetier_errors_total{reason="capacity"} 1.0' in body
    assert await asyncio.to_thread(fetch, "/readyz") == (503, b"not ready\n")
    ready.is_set = True
    assert await asyncio.to_thread(fetch, "/readyz") == (200, b"ready\n")
    assert (await asyncio.to_thread(fetch, "/nope"))[0] == 404


async def test_head_and_other_methods(served) -> None:
    server, _, _ = served
    status, headers, body = await raw_request(server.port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
    assert (status, headers["Content-Length"], body) == (200, "3", b"")
    status, _, _ = await raw_request(server.port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert status == 405


async def test_garbage_does_not_kill_the_server(served) -> None:
    server, _, _ = served
    status, _, _ = await raw_request(server.port, b"\x00\xff\xfe garbage\r\n\r\n")
    assert status == 400
    status, _, _ = await raw_request(server.port, b"GET " + b"/a" * 10000 + b" HTTP/1.1\r\n\r\n")
    assert status == 400

    # A client that connects and vanishes, and one that sends half a line and vanishes.
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.close()
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /hea")
    await writer.drain()
    writer.close()

    assert (await raw_request(server.port, get(server.port, "/healthz")))[0] == 200


async def test_slow_client_is_dropped_and_close_cancels_open_connections() -> None:
    server = MetricsServer(Metrics(), "127.0.0.1", 0, lambda: True, read_timeout=0.2)
    await server.start()
    port = server.port
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # timed out, closed without a reply
        writer.close()
        reader, lingering = await asyncio.open_connection("127.0.0.1", port)
    finally:
        await server.close()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # close() ended the open connection
    lingering.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
