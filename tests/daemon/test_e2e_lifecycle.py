"""End to end, daemon in a subprocess: signals, shutdown and restart on the same disk.

- SIGTERM with requests in flight — puts through shared memory and inline from two
  clients, and an inline LOAD of 32 MiB to a raw client that never reads its reply (so
  that request can only end by cancellation): every SDK call ends with its result or a
  typed ``StatetierError``; the process exits 0 once the grace has cancelled the stuck
  request; the socket file is gone.
- Restart on the same directory: every put that was acknowledged before the SIGTERM
  loads back bit for bit (write-behind was flushed to disk at shutdown), verified under
  the keyring the first run generated and left in the disk directory (same bytes, 0600).
- A second SIGINT during a shutdown that is waiting on a stuck request exits at once
  (exit code 130) instead of waiting out the grace.
"""

from __future__ import annotations

import asyncio
import signal
import stat

from statetier.clients import AsyncClient
from statetier.launch.daemons import DaemonProcess
from statetier.protocol.errors import StatetierError, Unavailable
from statetier.protocol.frames import Frame, FrameDecoder, Op, encode_frame_bytes, hello_frame
from statetier.protocol.identity import StateRef
from statetier.protocol.wire_meta import LoadMeta, wire_ref
from tests.support.jamba import assert_same_tensors, jamba_namespace, kv_page, snapshot
from tests.support.waiting import eventually

GRACE_SECONDS = 3
BIG_TOKENS = 8192  # a (2, 8, 8192, 128) bf16 page: 32 MiB, more than both socket buffers hold
SPEC = jamba_namespace("lifecycle")


class StuckReader:
    """A raw connection that asks for a large inline LOAD and never reads the reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def load(cls, daemon: DaemonProcess, ref: StateRef) -> "StuckReader":
        reader, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
        writer.write(encode_frame_bytes(hello_frame(tenant="default", client="stuck")))
        decoder, frames = FrameDecoder(1 << 20), []
        while not frames:
            data = await asyncio.wait_for(reader.read(4096), 10)
            assert data, "the daemon closed the connection during HELLO"
            frames = decoder.feed(data)
        assert frames[0].op is Op.HELLO_OK
        meta = LoadMeta(SPEC.namespace().digest, ref=wire_ref(ref))
        writer.write(encode_frame_bytes(Frame(Op.LOAD, 1, meta)))
        await writer.drain()
        return cls(reader, writer)

    def close(self) -> None:
        self.writer.transport.abort()


async def in_flight(client: AsyncClient, at_least: int) -> bool:
    """The daemon runs ``at_least`` requests, counting the STATS that asks."""
    stats = await client.stats()
    return stats["daemon"]["inflight_requests"] >= at_least


async def is_stuck_sending(client: AsyncClient) -> bool:
    return await in_flight(client, 2)  # the stuck LOAD, and this STATS


async def put_one(client: AsyncClient, layer: int) -> tuple[StateRef, dict] | StatetierError:
    page = kv_page(layer, 512)  # 2 MiB
    try:
        return await client.put_kv(layer, bytes(32), 0, 512, page, request_id="in-flight"), page
    except StatetierError as exc:
        return exc


async def test_sigterm_finishes_or_cancels_in_flight_requests_and_a_restart_serves_what_was_stored() -> None:
    daemon = DaemonProcess(name="sigterm", host_capacity="256MiB",
                           settings={"limits.shutdown_grace_seconds": GRACE_SECONDS})
    try:
        daemon.start()
        keyring = daemon.disk_dir / "keyring.json"
        keyring_bytes = keyring.read_bytes()
        async with AsyncClient(daemon.url, namespace=SPEC) as zero_copy, \
                   AsyncClient(daemon.url, namespace=SPEC, use_shm=False) as inline:
            early = await zero_copy.put_ssm(0, bytes(32), 64, snapshot(0), request_id="early")
            big = await zero_copy.put_kv(99, bytes(32), 0, BIG_TOKENS, kv_page(99, BIG_TOKENS), request_id="big")
            stuck = await StuckReader.load(daemon, big)
            # the daemon is writing the 32 MiB reply into a full socket
            await eventually(lambda: is_stuck_sending(inline), "the LOAD to the stuck reader started")

            tasks = [asyncio.ensure_future(put_one(zero_copy if i % 2 else inline, i)) for i in range(12)]

            async def puts_reached_the_daemon() -> bool:
                return any(task.done() for task in tasks) or await in_flight(inline, 3)

            await eventually(puts_reached_the_daemon, "the first puts on the wire")
            daemon.send_signal(signal.SIGTERM)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), GRACE_SECONDS + 30)
            # the stuck reader stays connected until the daemon has exited: only the grace
            # deadline, never a closed connection, may end its LOAD
            exit_code = await asyncio.get_running_loop().run_in_executor(None, daemon.wait, GRACE_SECONDS + 30)
            stuck.close()

        assert exit_code == 0, daemon.log_tail()
        assert not daemon.socket_path.exists()
        assert "cancelling 1 requests still running" in daemon.log_text()
        # received requests finished (only the stuck LOAD was cancelled, as logged); the rest,
        # e.g. a commit sent after the daemon stopped reading, end as a clean Unavailable
        stored = [outcome for outcome in outcomes if isinstance(outcome, tuple)]
        assert all(isinstance(o, tuple) or isinstance(o, Unavailable) for o in outcomes), outcomes

        daemon.start()  # the same directory: segments, index and keyring
        assert keyring.read_bytes() == keyring_bytes
        assert stat.S_IMODE(keyring.stat().st_mode) == 0o600
        async with AsyncClient(daemon.url, namespace=SPEC) as client:
            assert_same_tensors(await client.load(early), snapshot(0))
            assert_same_tensors(await client.load(big), kv_page(99, BIG_TOKENS))
            for ref, page in stored:
                assert_same_tensors(await client.load(ref), page)
        assert daemon.stop() == 0
    finally:
        print(f"--- log tail:\n{daemon.log_tail()}")
        daemon.close()


async def test_a_second_sigint_during_shutdown_exits_at_once() -> None:
    daemon = DaemonProcess(name="sigint", host_capacity="128MiB", settings={"limits.shutdown_grace_seconds": 600})
    try:
        daemon.start()
        async with AsyncClient(daemon.url, namespace=SPEC) as client:
            big = await client.put_kv(0, bytes(32), 0, BIG_TOKENS, kv_page(0, BIG_TOKENS), request_id="big")
            stuck = await StuckReader.load(daemon, big)
            await eventually(lambda: is_stuck_sending(client), "the LOAD to the stuck reader started")
            daemon.send_signal(signal.SIGINT)
            await eventually(lambda: "shutting down" in daemon.log_text(), "the daemon logged its shutdown")
            assert daemon.is_running  # waiting for the stuck LOAD, up to 600 s
            daemon.send_signal(signal.SIGINT)
            code = await asyncio.to_thread(daemon.wait, 30)
            stuck.close()
        assert code == 130
    finally:
        print(f"--- log tail:\n{daemon.log_tail()}")
        daemon.close()
