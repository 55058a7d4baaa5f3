"""End to end, daemon in a subprocess: bad input, dead clients, crowds and a Redis outage.

- Garbage bytes, and a frame whose length prefix is past ``limits.max_frame_bytes``: that
  connection gets one ERROR frame (request id 0; ``frame_too_large`` / ``malformed_frame``,
  counted in ``statetier_errors_total``) and EOF; a client connected alongside keeps working.
- A client process SIGKILLed while it holds shared-memory loads it never released, lookup
  leases and load-window regions: the daemon drops them all (stats back to 0
  leases), the host arena holds exactly the committed objects again, and
  after deleting those exactly what it held before the client came.
- 64 clients at once, each on its own connection (half through shared memory, half
  inline), a bounded number of puts, loads and lookups each: every round trip exact, the
  test finishes (no deadlock), and the daemon's VmRSS stays under an absolute bound.
- Redis (``fresh_redis``) stopped and restarted under load: while it is down, local puts and
  loads by ref of local copies are served (issue 35: fenced by what this daemon knows of
  each stream) and a publish fails with ``Unavailable`` (``RegistryUnavailable``), nothing
  else; after the restart published puts work again; every object whose put succeeded,
  before, during or after, loads back bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from statetier.clients import AsyncClient
from statetier.launch.daemons import DaemonProcess
from statetier.protocol.errors import Unavailable
from statetier.protocol.frames import Frame, FrameDecoder, Op, encode_frame_bytes, hello_frame
from statetier.protocol.messages import ref_from_wire
from tests.support.daemons import daemon_fixture
from tests.support.jamba import assert_same_tensors, jamba_namespace, kv_page, snapshot
from tests.support.waiting import eventually

MAX_FRAME = 8 << 20
CLIENTS = 64
OPS_PER_CLIENT = 4
RSS_BOUND = 768 << 20  # the whole 256 MiB arena touched + the interpreter (~50 MiB), with room to spare


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, name="robust", host_capacity="256MiB",
                          settings={"limits.max_frame_bytes": MAX_FRAME})


def host_stats(stats: dict) -> dict:
    return next(tier for tier in stats["tiers"] if tier["tier"] == "host")


# -- malformed input -------------------------------------------------------------------


async def read_until_closed(reader: asyncio.StreamReader) -> list[Frame]:
    decoder, frames = FrameDecoder(1 << 20), []
    for _ in range(64):  # bounded: the daemon sends one error frame, then EOF
        data = await asyncio.wait_for(reader.read(65536), 10)
        if not data:
            return frames
        frames += decoder.feed(data)
    raise AssertionError("the daemon kept the broken connection open")


HELLO = encode_frame_bytes(hello_frame((2,), tenant="default", client="raw"))


@pytest.mark.parametrize(("raw", "reason"), [
    pytest.param(b"GET / HTTP/1.1\r\nHost: statetier\r\n\r\n" + os.urandom(256), "frame_too_large", id="garbage"),
    pytest.param(HELLO + struct.pack("<IBBHQI", MAX_FRAME + 1, int(Op.PUT), 0, 0, 1, 2) + b"{}",
                 "frame_too_large", id="oversized-frame"),
    pytest.param(HELLO + struct.pack("<IBBHQI", 16, 0xEE, 0, 0, 7, 0), "malformed_frame", id="unknown-opcode"),
])
async def test_bad_input_closes_only_that_connection(daemon, raw: bytes, reason: str) -> None:
    async with AsyncClient(daemon.url, namespace=jamba_namespace("robust-bystander")) as bystander:
        ref = await bystander.put_kv(0, bytes(32), 0, 16, kv_page(1, 16), request_id="bystander")
        before = daemon.scrape()

        reader, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
        writer.write(raw)
        frames = await read_until_closed(reader)
        writer.close()
        errors = [f for f in frames if f.is_error]
        assert [(f.request_id, f.meta["reason"]) for f in errors] == [(0, reason)]

        assert daemon.scrape().delta(before, "statetier_errors_total", reason=reason) == 1
        assert_same_tensors(await bystander.load(ref), kv_page(1, 16))
        async with AsyncClient(daemon.url) as newcomer:
            assert await newcomer.ping() >= 0


# -- a client killed while holding leases --------------------------------------------------

LEASE_HOLDER = r'''
import asyncio, json, sys
import torch
from statetier.clients import AsyncClient
from statetier.clients.transport import connect
from statetier.protocol.frames import Op
from statetier.protocol.identity import NamespaceSpec, Provenance
from statetier.protocol.messages import ref_to_wire
from statetier.protocol.wire_meta import LoadAnswer, LoadMeta, LookupMeta, LookupReply, decode_reply, wire_ref

async def main(url):
    spec = NamespaceSpec(model_id="lease-holder", kv_block_size=64)
    async with AsyncClient(url, namespace=spec) as client:
        page = lambda i: {"kv": torch.full((2, 8, 64, 128), float(i), dtype=torch.bfloat16)}
        refs = [await client.put_kv(i, bytes(32), 0, 64, page(i), request_id="holder") for i in range(4)]
        conn = await connect(url, shm=True)
        ns = spec.namespace().digest
        for ref in refs:  # shared-memory loads whose window regions are never given back
            reply = await conn.request(Op.LOAD, LoadMeta(ns, ref=wire_ref(ref), shm=True))
            assert isinstance(decode_reply(LoadAnswer, reply.meta).region, int)
        found = await conn.request(Op.LOOKUP, LookupMeta(ns, ((64, bytes(32)),), (0, 1, 2, 3), kv_layout="prefix"))
        tokens = decode_reply(LookupReply, found.meta).tokens
        print(json.dumps({"refs": [ref_to_wire(r) for r in refs], "lookup": tokens}), flush=True)
        await asyncio.sleep(600)  # the behaviour: a client holding all this until the test kills it

asyncio.run(main(sys.argv[1]))
'''


async def test_a_killed_client_leaves_no_lease_and_no_window_region_behind(daemon, tmp_path: Path) -> None:
    async with AsyncClient(daemon.url) as observer:
        before = await observer.stats()
        assert before["leases"] == 0
        script = tmp_path / "lease_holder.py"
        script.write_text(LEASE_HOLDER)
        child = subprocess.Popen([sys.executable, str(script), daemon.url], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
            assert line, child.stderr.read()
            held = json.loads(line)
            refs = [ref_from_wire(r) for r in held["refs"]]
            assert held["lookup"] == 64

            during = await observer.stats()  # 4 lookup leases; 4 load-window regions
            assert (during["leases"], during["daemon"]["window_regions"]) == (4, 4)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
            child.stderr.close()

        async def released() -> bool:
            stats = await observer.stats()
            return (stats["leases"], stats["daemon"]["window_regions"], host_stats(stats)["leases"]) == (0, 0, 0)

        await eventually(released)

        deleter = AsyncClient(daemon.url, namespace=jamba_namespace("unused"))
        async with deleter:
            for ref in refs:
                assert await deleter.delete(ref) >= 1
        assert host_stats(await observer.stats())["bytes_used"] == host_stats(before)["bytes_used"]


# -- a crowd -------------------------------------------------------------------------------


async def one_client(url: str, index: int) -> None:
    """A bounded session: puts, loads by ref and by key, one lookup; every byte checked."""
    async with AsyncClient(url, namespace=jamba_namespace(f"crowd-{index % 4}"), use_shm=index % 2 == 0) as client:
        for op in range(OPS_PER_CLIENT):
            layer, seed = index, index * 100 + op
            page = kv_page(seed, 16 * (1 + op % 4))  # 64 KiB to 256 KiB
            tokens = page["kv"].shape[2]
            prefix = struct.pack("<II", index, op) + bytes(24)
            ref = await client.put_kv(layer, prefix, 0, tokens, page, request_id=f"crowd-{index}")
            assert_same_tensors(await client.load(ref), page)
            assert_same_tensors(await client.load(client.kv_key(layer, prefix, 0, tokens)), page)
            found = await client.lookup([layer], [], [(tokens, prefix)], kv_layout="prefix")
            assert found.tokens == tokens
            await client.release(found.lease_ids)


async def test_64_concurrent_clients_round_trip_exactly_in_bounded_memory(daemon) -> None:
    rss_before = daemon.rss_bytes()
    await asyncio.wait_for(asyncio.gather(*(one_client(daemon.url, i) for i in range(CLIENTS))), 120)
    rss_after = daemon.rss_bytes()
    async with AsyncClient(daemon.url) as observer:
        stats = await observer.stats()
    assert stats["leases"] == 0
    assert rss_after < RSS_BOUND, f"daemon RSS grew from {rss_before >> 20} MiB to {rss_after >> 20} MiB"


# -- Redis goes away and comes back ----------------------------------------------------


async def test_a_redis_outage_degrades_to_unavailable_and_corrupts_nothing(fresh_redis) -> None:
    daemon = DaemonProcess(name="outage", redis_url=fresh_redis.url, host_capacity="128MiB",
                           settings={"redis.socket_timeout": 1.0})
    try:
        daemon.start()
        async with AsyncClient(daemon.url, namespace=jamba_namespace("outage")) as client:
            stored: list[tuple[object, dict]] = []
            outcomes: dict[str, list[str]] = {"before": [], "during": [], "after": []}

            async def work(phase: str, count: int) -> None:
                for i in range(count):
                    seed = len(stored) * 1000 + i
                    state = snapshot(seed)
                    try:
                        ref = await client.put_ssm(i % 3, bytes(32), 64 * (i + 1), state,
                                                   request_id=f"{phase}-{i}", publish=i % 2 == 1)
                    except Unavailable:
                        outcomes[phase].append("put:unavailable")
                        continue
                    outcomes[phase].append("put:ok")
                    stored.append((ref, state))

            await work("before", 4)
            fresh_redis.stop()
            await work("during", 2)  # each refusal costs redis-py's reconnect attempts: keep few
            during_load = []
            for ref, state in stored[:2]:
                try:
                    assert_same_tensors(await client.load(ref), state)
                    during_load.append("ok")
                except Unavailable:
                    during_load.append("unavailable")
            fresh_redis.restart()

            async def published() -> bool:
                try:
                    ref = await client.put_ssm(7, bytes(32), 64, snapshot(7), request_id="probe", publish=True)
                except Unavailable:
                    return False
                stored.append((ref, snapshot(7)))
                return True

            await eventually(published, timeout=30, interval=0.2)
            await work("after", 4)

            assert outcomes["before"] == ["put:ok"] * 4
            assert outcomes["during"] == ["put:ok", "put:unavailable"]  # local served, publish refused
            assert during_load == ["ok"] * 2  # local copies: served through the outage
            assert outcomes["after"] == ["put:ok"] * 4
            assert len(stored) == 4 + 1 + 1 + 4
            for ref, state in stored:  # nothing half-written or mixed up, wherever it is served from
                assert_same_tensors(await client.load(ref), state)
        assert daemon.stop() == 0
    finally:
        print(f"--- log tail:\n{daemon.log_tail()}")
        daemon.close()
