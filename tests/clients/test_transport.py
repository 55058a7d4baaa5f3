"""The client connection against a real asyncio peer that speaks the frame protocol.

``FramePeer`` is a small server written for these tests (not a stand-in for a tier): it
answers HELLO, PING and a few opcodes with behaviours a test asks for — hold replies and
send them in reverse order, answer with an error frame, never answer, drop the socket.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from statetier.clients.endpoint import Endpoint, parse_url
from statetier.clients.transport import connect
from statetier.protocol.errors import (Busy, ClientClosedError, FrameTooLarge, InvalidRequest, MalformedFrame, NotFound,
                                       Unauthorized, Unavailable, UnsupportedProtocol)
from statetier.protocol.frames import (Frame, FrameDecoder, Op, encode_frame, encode_frame_bytes, error_frame,
                                       hello_ok_frame)
from tests.support.waiting import eventually


class FramePeer:
    """A frame-speaking server on a Unix socket (or TCP); records what it received.

    Opcodes: PING → PONG; STATS → held until ``hold`` requests are waiting, then all
    answered in reverse arrival order with ``{"tag": ...}``; PUT → echo of the data;
    INSPECT → NotFound; DELETE → never answered; VERIFY → the socket is dropped;
    LOAD → answered ``{"lease": 7}`` once ``release_load`` is set.
    """

    def __init__(self, *, hello: dict | None = None, reject_token: str | None = None,
                 answer_hello: bool = True, hold: int = 1) -> None:
        self.hello = {"max_frame": 64 << 20, "tenant": "default", "max_inflight": 64, "shm": None,
                      **(hello or {})}
        self.reject_token = reject_token
        self.answer_hello = answer_hello
        self.hold = hold
        self.received: list[Frame] = []
        self.held: list[Frame] = []
        self.outstanding = 0
        self.max_outstanding = 0
        self.release_load = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []
        self.pongs: list[Frame] = []
        self.server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start_unix(self, path: Path) -> str:
        self.server = await asyncio.start_unix_server(self._serve, path=str(path))
        return f"unix://{path}"

    async def start_tcp(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        for task in self._tasks:
            task.cancel()
        self.server.close()
        await self.server.wait_closed()

    def ops(self) -> list[Op]:
        return [f.op for f in self.received]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        decoder = FrameDecoder(256 << 20)
        try:
            while data := await reader.read(1 << 20):
                for frame in decoder.feed(data):
                    self.received.append(frame)
                    self._answer(frame, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.transport.abort()

    def _send(self, writer: asyncio.StreamWriter, frame: Frame) -> None:
        if not writer.transport.is_closing():
            writer.writelines(encode_frame(frame, 256 << 20))

    def _answer(self, frame: Frame, writer: asyncio.StreamWriter) -> None:
        rid = frame.request_id
        if frame.op is Op.HELLO:
            if frame.meta.get("token") == self.reject_token is not None:
                self._send(writer, error_frame(0, Unauthorized("bad token")))
                writer.transport.close()
            elif self.answer_hello:
                self._send(writer, hello_ok_frame(self.hello.pop("version", 3), **self.hello))
        elif frame.op is Op.PING:
            self._send(writer, Frame(Op.PONG, rid, {}))
        elif frame.op is Op.PONG:
            self.pongs.append(frame)
        elif frame.op is Op.STATS:
            self.held.append(frame)
            self._track(+1)
            if len(self.held) >= self.hold:
                held, self.held = self.held, []
                for h in reversed(held):
                    self._track(-1)
                    self._send(writer, Frame(Op.REPLY, h.request_id, {"tag": h.meta.get("tag")}))
        elif frame.op is Op.PUT:
            self._send(writer, Frame(Op.REPLY, rid, {"n": len(frame.data)}, bytes(frame.data)))
        elif frame.op is Op.INSPECT:
            self._send(writer, error_frame(rid, NotFound("no such state_id")))
        elif frame.op is Op.VERIFY:
            writer.transport.abort()
        elif frame.op is Op.LOAD:
            self._spawn(self._answer_load_later(rid, writer))

    async def _answer_load_later(self, rid: int, writer: asyncio.StreamWriter) -> None:
        await self.release_load.wait()
        self._send(writer, Frame(Op.REPLY, rid, {"lease": 7}))

    def _track(self, delta: int) -> None:
        self.outstanding += delta
        self.max_outstanding = max(self.max_outstanding, self.outstanding)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@pytest.fixture
async def peer(tmp_path: Path):
    peers: list[FramePeer] = []

    async def start(**options) -> tuple[FramePeer, str]:
        p = FramePeer(**options)
        peers.append(p)
        return p, await p.start_unix(tmp_path / f"peer{len(peers)}.sock")

    yield start
    for p in peers:
        await p.close()


async def delete_in_flight(peer):
    """A connection to a new peer, and a DELETE on it that the peer has received and never answers."""
    server, url = await peer()
    conn = await connect(url)
    pending = asyncio.ensure_future(conn.request(Op.DELETE, {}))
    await eventually(lambda: Op.DELETE in server.ops())
    return server, conn, pending


# -- urls and handshake --------------------------------------------------------------------


def test_urls_name_unix_sockets_or_tcp_endpoints() -> None:
    assert parse_url("unix:///run/statetier.sock") == Endpoint(path="/run/statetier.sock")
    assert parse_url("unix:rel/d.sock") == Endpoint(path="rel/d.sock")
    assert parse_url("/tmp/d.sock") == Endpoint(path="/tmp/d.sock")
    assert parse_url("tcp://cache-1:7400") == Endpoint(host="cache-1", port=7400)
    assert parse_url("tcps://[::1]:7400") == Endpoint(host="::1", port=7400, tls=True)
    for url in ("unix:///run/statetier.sock", "unix://rel/d.sock", "tcp://cache-1:7400", "tcps://[::1]:7400"):
        assert str(parse_url(url)) == url  # what messages name: the URL, never a repr (issue 41)
    for bad in ("", "http://x:1", "tcp://host", "tcp://:80", "unix://"):
        with pytest.raises(InvalidRequest):
            parse_url(bad)


async def test_handshake_sends_hello_and_keeps_hello_ok(peer) -> None:
    server, url = await peer(hello={"shm": None, "max_inflight": 8})
    conn = await connect(url, tenant="acme", token="s3cret")
    try:
        hello = server.received[0]
        assert hello.op is Op.HELLO and hello.request_id == 0
        assert hello.meta["versions"] == [3]
        assert hello.meta["tenant"] == "acme" and hello.meta["token"] == "s3cret"
        assert hello.meta["shm"] is True and hello.meta["client"].startswith("statetier-python")
        assert conn.hello["version"] == 3 and conn.hello["max_inflight"] == 8
        assert conn.shm is None and conn.max_frame == 64 << 20
        pong = await conn.request(Op.PING, {})
        assert pong.op is Op.PONG
    finally:
        await conn.close()


async def test_tcp_connection_does_not_ask_for_shared_memory() -> None:
    server = FramePeer()
    url = await server.start_tcp()
    try:
        conn = await connect(url, shm=True)
        assert server.received[0].meta["shm"] is False
        assert "token" not in server.received[0].meta
        await conn.request(Op.PING, {})
        await conn.close()
    finally:
        await server.close()


async def test_rejected_token_raises_unauthorized(peer) -> None:
    _, url = await peer(reject_token="wrong")
    with pytest.raises(Unauthorized, match="bad token"):
        await connect(url, token="wrong")


async def test_unknown_protocol_version_is_refused(peer) -> None:
    _, url = await peer(hello={"version": 99})
    with pytest.raises(UnsupportedProtocol):
        await connect(url)


async def test_silent_daemon_times_out_as_unavailable(peer) -> None:
    _, url = await peer(answer_hello=False)
    with pytest.raises(Unavailable, match="handshake"):
        await connect(url, timeout=0.3)


async def test_nothing_listening_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="cannot connect"):
        await connect(f"unix://{tmp_path / 'absent.sock'}")


# -- requests ------------------------------------------------------------------------------


async def test_replies_out_of_order_reach_their_own_callers(peer) -> None:
    server, url = await peer(hold=3)
    conn = await connect(url)
    try:
        finished: list[str] = []

        async def ask(tag: str) -> str:
            frame = await conn.request(Op.STATS, {"tag": tag})
            finished.append(tag)
            return frame.meta["tag"]

        results = await asyncio.gather(ask("a"), ask("b"), ask("c"))
        assert results == ["a", "b", "c"]
        assert finished == ["c", "b", "a"]  # the peer answered in reverse
        ids = [f.request_id for f in server.received if f.op is Op.STATS]
        assert len(set(ids)) == 3 and 0 not in ids
    finally:
        await conn.close()


async def test_in_flight_requests_are_bounded_by_max_inflight(peer) -> None:
    server, url = await peer(hello={"max_inflight": 2}, hold=2)
    conn = await connect(url)
    try:
        tags = [str(i) for i in range(6)]
        results = await asyncio.gather(*(conn.request(Op.STATS, {"tag": t}) for t in tags))
        assert [r.meta["tag"] for r in results] == tags
        assert server.max_outstanding == 2
    finally:
        await conn.close()


async def test_error_reply_raises_its_typed_error_and_the_connection_stays_usable(peer) -> None:
    _, url = await peer()
    conn = await connect(url)
    try:
        with pytest.raises(NotFound, match="no such state_id") as info:
            await conn.request(Op.INSPECT, {"state_id": "00"})
        assert info.value.reason == "not_found" and info.value.code == 200
        assert (await conn.request(Op.PING, {})).op is Op.PONG
    finally:
        await conn.close()


async def test_large_payloads_and_scattered_buffers_arrive_whole(peer) -> None:
    server, url = await peer()
    conn = await connect(url)
    try:
        big = bytes(range(256)) * (32 * 1024)  # 8 MiB
        echoed = await conn.request(Op.PUT, {}, big)
        assert echoed.meta["n"] == len(big)
        assert isinstance(echoed.data, memoryview) and echoed.data == big

        parts = [b"head", memoryview(bytearray(b"x" * 100_000)), b"", bytearray(b"tail")]
        echoed = await conn.request(Op.PUT, {}, parts)
        assert bytes(echoed.data) == b"head" + b"x" * 100_000 + b"tail"
    finally:
        await conn.close()


async def test_oversized_request_is_refused_locally(peer) -> None:
    _, url = await peer(hello={"max_frame": 4096})
    conn = await connect(url)
    try:
        with pytest.raises(FrameTooLarge):
            await conn.request(Op.PUT, {}, bytes(8192))
        with pytest.raises(FrameTooLarge):
            await conn.request(Op.PUT, {}, [bytes(3000), bytes(3000)])
        assert (await conn.request(Op.PING, {})).op is Op.PONG
    finally:
        await conn.close()


async def test_daemon_ping_is_answered_with_pong(peer) -> None:
    server, url = await peer()
    conn = await connect(url)
    try:
        server.writers[0].write(encode_frame_bytes(Frame(Op.PING, 77, {})))
        await eventually(lambda: server.pongs)
        assert server.pongs[0].request_id == 77
    finally:
        await conn.close()


# -- failures ------------------------------------------------------------------------------


async def test_lost_connection_fails_pending_requests_with_unavailable(peer) -> None:
    server, url = await peer()
    conn = await connect(url)
    pending = [asyncio.ensure_future(conn.request(Op.DELETE, {})) for _ in range(3)]
    await eventually(lambda: server.ops().count(Op.DELETE) == 3)
    dropper = asyncio.ensure_future(conn.request(Op.VERIFY, {}))  # the peer drops the socket
    for call in [*pending, dropper]:
        with pytest.raises(Unavailable, match="connection to the daemon lost"):
            await call
    assert not conn.is_usable
    with pytest.raises(Unavailable):
        await conn.request(Op.PING, {})
    await conn.close()


async def test_close_fails_pending_calls_and_later_calls_with_client_closed(peer) -> None:
    server, conn, pending = await delete_in_flight(peer)
    await conn.close()
    with pytest.raises(ClientClosedError):
        await pending
    with pytest.raises(ClientClosedError):
        await conn.request(Op.PING, {})
    await eventually(lambda: Op.GOODBYE in server.ops())
    await conn.close()  # idempotent


async def test_connection_level_error_fails_pending_requests_with_it(peer) -> None:
    server, conn, pending = await delete_in_flight(peer)
    server.writers[0].write(encode_frame_bytes(error_frame(0, Busy("too many connections"))))
    with pytest.raises(Busy, match="too many connections"):
        await pending
    with pytest.raises(Busy):
        await conn.request(Op.PING, {})
    await conn.close()


async def test_malformed_bytes_from_the_daemon_fail_the_connection(peer) -> None:
    server, conn, pending = await delete_in_flight(peer)
    server.writers[0].write(struct.pack("<IBBHQI", 16, 0xEE, 0, 0, 1, 0))  # unknown opcode
    with pytest.raises(MalformedFrame):
        await pending
    assert not conn.is_usable
    await conn.close()


async def test_reply_to_a_cancelled_request_goes_to_its_orphan_handler(peer) -> None:
    server, url = await peer()
    conn = await connect(url)
    try:
        orphans: list[Frame] = []

        async def cleanup(frame: Frame) -> None:
            orphans.append(frame)
            await conn.request(Op.PING, {})

        call = asyncio.ensure_future(conn.request(Op.LOAD, {}, on_orphan=cleanup))
        await eventually(lambda: Op.LOAD in server.ops())
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        server.release_load.set()
        await eventually(lambda: orphans and Op.PING in server.ops())
        assert orphans[0].meta == {"lease": 7}
    finally:
        await conn.close()

