"""The daemon's wire behaviour over a real Unix socket: handshake, framing, backpressure, lifecycle.

Every test runs a real Server over a real Engine and HostTier (``server_harness``) and
talks raw frames encoded with ``protocol/frames.py``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct

import pytest
import uvloop

from statetier.daemon.config import TenantConfig
from statetier.daemon.server import Server
from statetier.daemon.server.frame_writer import ConnectionClosed, FrameWriter
from statetier.protocol.errors import ConfigError
from statetier.protocol.frames import FLAG_BINARY, HEADER_SIZE, Frame, FrameDecoder, Op
from statetier.protocol.messages import ref_to_wire
from statetier.protocol.sealed import decode_header
from statetier.protocol.wire_meta import (
    LoadAnswer,
    LoadBatchMeta,
    LoadBatchReply,
    LoadMeta,
    LookupMeta,
    LookupReply,
    PutAnswer,
    PutBatchMeta,
    PutBatchReply,
    ReleaseMeta,
    ReleaseReply,
    encode,
    ref_of,
    wire_ref,
)
from tests.support.server_harness import NS, WireClient, answer, load_meta, metric, put_meta, running_daemon
from tests.support.waiting import eventually

STRANGER_UID = os.getuid() + 12345


async def connected(daemon, **hello) -> WireClient:
    client = await daemon.unix_client()
    reply = await client.hello(**hello)
    assert reply.op is Op.HELLO_OK, reply.meta
    return client


# -- handshake ------------------------------------------------------------------------


async def test_hello_ok_names_version_limits_and_tenant() -> None:
    async with running_daemon(limits={"max_inflight_per_connection": 7}) as daemon:
        client = await daemon.unix_client()
        reply = await client.hello(versions=[2, 3, 99], client="tests")
        assert reply.op is Op.HELLO_OK and reply.request_id == 0
        assert reply.meta == {
            "version": 3,
            "max_frame": daemon.config.limits.max_frame_bytes,
            "tenant": "default",
            "max_inflight": 7,
            "shm": None,
        }
        pong = await client.request(Op.PING)
        assert (pong.op, pong.meta) == (Op.PONG, {})
        await client.close()


async def test_the_first_frame_must_be_hello() -> None:
    async with running_daemon() as daemon:
        client = await daemon.unix_client()
        client.send(Frame(Op.PING, 1, {}))
        error = await client.recv()
        assert error.is_error and error.request_id == 0
        assert error.meta["code"] == 400 and "first frame must be HELLO" in error.meta["message"]
        assert await client.recv() is None


async def test_no_common_version_is_refused_and_closed() -> None:
    async with running_daemon() as daemon:
        client = await daemon.unix_client()
        error = await client.hello(versions=[7, 8])
        assert error.is_error and error.meta["code"] == 403
        assert await client.recv() is None


async def test_a_tenant_the_peer_does_not_belong_to_is_forbidden() -> None:
    async with running_daemon() as daemon:
        client = await daemon.unix_client()
        error = await client.hello(tenant="someone-else")
        assert error.is_error and error.meta["code"] == 421
        assert await client.recv() is None
        assert metric(daemon.metrics, "statetier_auth_failures_total", reason="tenant") == 1


async def test_a_hello_token_with_a_lone_surrogate_is_a_typed_refusal_not_an_internal_error(caplog) -> None:
    async with running_daemon(tenants=(TenantConfig(name="a", token_sha256="0" * 64),)) as daemon:
        client = await daemon.unix_client()
        raw_hello = b'{"versions":[1],"token":"\\udc80","tenant":"a"}'
        client.send_raw(struct.pack("<IBBHQI", 16 + len(raw_hello), int(Op.HELLO), 0, 0, 1, len(raw_hello)) + raw_hello)
        error = await client.recv()
        assert error.is_error and error.request_id == 0 and error.meta["reason"] == "malformed_frame"
        assert "surrogate" in error.meta["message"]
        assert await client.recv() is None
        assert metric(daemon.metrics, "statetier_errors_total", reason="internal") == 0
        assert not [r for r in caplog.records if r.exc_info]
        healthy = await daemon.unix_client()  # the daemon goes on
        assert (await healthy.hello(tenant="default")).is_error  # no default tenant: refused, typed
        await healthy.close()


async def test_a_binary_meta_string_that_is_not_utf8_is_an_invalid_request_and_the_connection_goes_on() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        meta, nbytes = put_meta()
        raw = encode(meta).replace(b"req-0", b"\xed\xb2\x80-0")  # a lone surrogate as UTF-8 bytes
        head = struct.pack("<IBBHQI", 16 + len(raw) + nbytes, int(Op.PUT), FLAG_BINARY, 0, 5, len(raw))
        client.send_raw(head + raw + bytes(nbytes))
        error = await client.recv()
        assert error.is_error and error.request_id == 5 and error.meta["reason"] == "invalid_request"
        assert "utf-8" in error.meta["message"].lower()
        assert (await client.request(Op.PING)).op is Op.PONG
        assert metric(daemon.metrics, "statetier_errors_total", reason="internal") == 0


async def test_a_hot_op_with_a_json_meta_is_refused_by_name() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        error = await client.request(Op.LOOKUP, {"ns": NS.hex()})
        assert error.is_error and error.meta["message"] == "LOOKUP meta must be MessagePack (protocol 3)"
        assert (await client.request(Op.PING)).op is Op.PONG


@pytest.mark.parametrize("op", [Op.LIST, Op.DELETE, Op.PURGE, Op.STATS, Op.INSPECT, Op.VERIFY])
async def test_an_admin_op_with_a_binary_meta_is_refused_by_name(op: Op) -> None:
    """The fuzz probe's find: the binary flag on an admin op handed its handler bytes where it
    reads a JSON map (an internal error); it is an invalid request, and the connection goes on."""
    async with running_daemon() as daemon:
        client = await connected(daemon)
        raw = encode(LookupMeta(ns=NS, boundaries=()))
        client.send_raw(struct.pack("<IBBHQI", 16 + len(raw), int(op), FLAG_BINARY, 0, 7, len(raw)) + raw)
        error = await client.recv()
        assert error.is_error and error.request_id == 7 and error.meta["reason"] == "invalid_request"
        assert error.meta["message"] == f"{op.name} meta must be JSON, not MessagePack"
        assert (await client.request(Op.PING)).op is Op.PONG
        assert metric(daemon.metrics, "statetier_errors_total", reason="internal") == 0


async def test_a_refused_tenant_name_is_logged_bounded_and_escaped(caplog) -> None:
    async with running_daemon() as daemon:
        client = await daemon.unix_client()
        error = await client.hello(tenant="x" * 20000 + "\n\x1b[31mforged log line")
        assert error.is_error and error.meta["code"] == 421
        assert len(error.meta["message"]) < 300
        await client.recv()
        (line,) = [r.getMessage() for r in caplog.records if "connection refused" in r.getMessage()]
        assert len(line) < 300 and "\n" not in line and "\x1b" not in line
        assert "xxxx" in line and "chars)" in line


async def test_peer_credentials_outside_allowed_uids_are_refused_before_hello() -> None:
    async with running_daemon(listen={"allowed_uids": (STRANGER_UID,)}) as daemon:
        client = await daemon.unix_client()
        error = await client.recv()  # sent without waiting for HELLO
        assert error.is_error and error.request_id == 0 and error.meta["code"] == 421
        assert f"peer uid {os.getuid()}" in error.meta["message"]
        assert await client.recv() is None
        assert metric(daemon.metrics, "statetier_auth_failures_total", reason="peer_credentials") == 1


async def test_the_arena_is_never_offered() -> None:
    async with running_daemon(arena=True) as daemon:
        client = await daemon.unix_client()
        shm = (await client.hello(shm=True)).meta["shm"]
        assert set(shm) == {"put_bytes", "load_bytes"}  # no path: nothing to open by name


@pytest.mark.parametrize("opcode", [11, 12, 13, 99], ids=["PUT_RESERVE", "PUT_COMMIT", "PUT_ABORT", "never_defined"])
async def test_the_retired_reservation_ops_are_refused_as_unknown_opcodes(opcode: int) -> None:
    async with running_daemon(arena=True) as daemon:
        client = await daemon.unix_client()
        await client.hello(shm=True)
        # a well-formed frame header with the retired opcode (Frame can no longer name it)
        meta = b'{"ticket":1}'
        client.send_raw(struct.pack("<IBBHQI", 16 + len(meta), opcode, 0, 0, 7, len(meta)) + meta)
        error = await client.recv()
        assert error.is_error and error.request_id == 0 and error.meta["reason"] == "malformed_frame"
        assert error.meta["message"] == f"unknown opcode {opcode}"
        assert await client.recv() is None  # that connection only is closed
        other = await daemon.unix_client()
        await other.hello()
        assert (await other.request(Op.PING, {})).op is Op.PONG


async def test_shared_memory_windows_are_offered_on_the_unix_socket_only_when_asked() -> None:
    async with running_daemon(arena=False) as daemon:
        client = await daemon.unix_client()
        window = daemon.config.host.window_bytes
        assert (await client.hello(shm=True)).meta["shm"] == {"put_bytes": window, "load_bytes": window}
        other = await daemon.unix_client()
        assert (await other.hello()).meta["shm"] is None


# -- malformed input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        pytest.param(b"\x00" * 64, 402, id="length-below-header"),
        pytest.param(b"garbage that is not a frame at all....", 401, id="garbage"),
        pytest.param(struct.pack("<IBBHQI", 16, 99, 0, 0, 5, 0), 402, id="unknown-opcode"),
        pytest.param(struct.pack("<IBBHQI", 18, 3, 0, 0, 5, 2) + b"[]", 402, id="meta-not-object"),
    ],
)
async def test_malformed_input_closes_that_connection_only(raw: bytes, code: int) -> None:
    async with running_daemon() as daemon:
        healthy = await connected(daemon)
        broken = await connected(daemon)
        broken.send_raw(raw)
        error = await broken.recv()
        assert error.is_error and error.request_id == 0 and error.meta["code"] == code
        assert await broken.recv() is None
        assert (await healthy.request(Op.PING)).op is Op.PONG
        late = await connected(daemon)
        assert (await late.request(Op.PING)).op is Op.PONG
        await eventually(lambda: daemon.server.stats()["connections"] == 2)


async def test_a_reply_after_the_half_close_of_a_failed_connection_is_connection_closed_not_a_crash() -> None:
    # A connection that failed (a malformed frame) writes its error and half-closes; a
    # request task still running then answers. Found by the fuzz probe: that answer raised
    # RuntimeError('Cannot call writelines() after write_eof()') inside the daemon.
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_connection(asyncio.Protocol, sock=left)
    try:
        writer = FrameWriter(transport, 1 << 20)
        writer.start()
        writer.send_nowait(Frame(Op.ERROR, 0, {"code": 402, "message": "bad", "reason": "malformed_frame"}, flags=1))
        writer.write_eof()
        with pytest.raises(ConnectionClosed):
            await writer.send(Frame(Op.REPLY, 7, {}))
        writer.send_nowait(Frame(Op.GOODBYE, 0, {}))  # ignored, not raised
        right.setblocking(False)
        received = await loop.sock_recv(right, 1 << 16)
        (frame,) = FrameDecoder().feed(received)
        assert frame.is_error and frame.request_id == 0
        assert await loop.sock_recv(right, 1 << 16) == b""  # then EOF, nothing after it
    finally:
        transport.close()
        right.close()


async def test_a_frame_over_max_frame_is_refused_from_its_length_prefix() -> None:
    async with running_daemon(limits={"max_frame_bytes": 4096}) as daemon:
        client = await connected(daemon)
        client.send_raw(struct.pack("<I", 1 << 20))  # nothing of the body is ever sent
        error = await client.recv()
        assert error.is_error and error.meta["code"] == 401
        assert await client.recv() is None


async def test_a_reply_only_opcode_from_a_client_is_an_invalid_request() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        for op in (Op.REPLY, Op.HELLO_OK, Op.PONG, Op.HELLO):
            error = await client.request(op, {})
            assert error.is_error and error.meta["code"] == 410, op
        assert (await client.request(Op.PING)).op is Op.PONG


async def test_request_id_zero_is_reserved() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        client.send(Frame(Op.PING, 0, {}))
        error = await client.recv()
        assert error.is_error and error.meta["code"] == 410 and "reserved" in error.meta["message"]
        assert (await client.request(Op.PING)).op is Op.PONG


async def test_bad_request_meta_is_answered_and_the_connection_survives() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        meta, nbytes = put_meta()
        meta.key.ns = b"short"
        error = await client.request(Op.PUT, meta, bytes(nbytes))
        assert error.is_error and error.meta["code"] == 410 and "$[0][0]" in error.meta["message"]  # key.ns
        error = await client.request(Op.LOAD, LoadMeta(b"zz"))
        assert error.is_error and error.meta["code"] == 410
        assert (await client.request(Op.PING)).op is Op.PONG
        assert metric(daemon.metrics, "statetier_errors_total", reason="invalid_request") == 2


# -- requests through the engine -------------------------------------------------------


async def test_many_requests_in_flight_on_one_connection_are_answered_by_id() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        payloads = {}
        for layer in range(8):
            meta, size = put_meta(layer)
            payloads[layer + 1] = os.urandom(size)
            client.send(Frame(Op.PUT, layer + 1, meta, payloads[layer + 1]))
        client.send(Frame(Op.PING, 100, {}))
        replies = {}
        for _ in range(9):
            frame = await client.recv()
            replies[frame.request_id] = frame
        assert sorted(replies) == [1, 2, 3, 4, 5, 6, 7, 8, 100]
        assert all(answer(replies[i], PutAnswer).tier == "host" for i in range(1, 9))


async def test_inline_put_then_load_returns_the_same_bytes_and_releases_the_lease() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        meta, size = put_meta(shape=(512, 1024))  # 1 MiB: a large frame both ways
        payload = os.urandom(size)
        ref = answer(await client.request(Op.PUT, meta, payload), PutAnswer).ref
        loaded = await client.request(Op.LOAD, load_meta(ref=ref))
        assert answer(loaded, LoadAnswer) == LoadAnswer("host", 0, len(loaded.data))
        header = decode_header(loaded.data)  # the whole sealed object: signed header, payload
        assert wire_ref(header.ref()) == ref
        assert bytes(loaded.data[header.header_len :]) == payload
        await eventually(lambda: daemon.leases() == 0)
        assert metric(daemon.metrics, "statetier_operations_total", tier="daemon", kind="kv", op="load") == 1


async def test_a_batch_of_puts_and_a_batch_of_loads_are_one_frame_each_answered_per_item() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        metas, payloads = [], []
        for layer in range(3):
            meta, size = put_meta(layer=layer)
            meta.data_len = size
            metas.append(meta)
            payloads.append(os.urandom(size))
        bad, size = put_meta(layer=9)
        bad.data_len = 5  # a payload shorter than its tensors
        metas.insert(1, bad)
        payloads.insert(1, b"short")
        put = await client.request(Op.PUT_BATCH, PutBatchMeta(tuple(metas)), b"".join(payloads))
        answers = answer(put, PutBatchReply).items
        assert [(a.ref is not None, a.error.code if a.error else None) for a in answers] == [
            (True, None), (False, 410), (False, None), (False, None)]
        assert answers[2:] == (PutAnswer(skipped=True),) * 2  # a batch stops at its first failure
        metas = [metas[0], metas[2], metas[3]]
        payloads = [payloads[0], payloads[2], payloads[3]]
        later = await client.request(Op.PUT_BATCH, PutBatchMeta(tuple(metas[1:])), b"".join(payloads[1:]))
        metas[0].data_len = None
        refs = [answer(await client.request(Op.PUT, metas[0], payloads[0]), PutAnswer).ref,
                *(a.ref for a in answer(later, PutBatchReply).items)]
        refs[2].state_id = bytes(16)
        loaded = await client.request(Op.LOAD_BATCH, LoadBatchMeta(NS.digest, tuple(LoadMeta(ref=ref) for ref in refs)))
        first, second, missing = answer(loaded, LoadBatchReply).items
        assert missing.error.code == 200  # NotFound, that item only
        for item, want in ((first, payloads[0]), (second, payloads[1])):
            blob = loaded.data[item.at : item.at + item.len]
            header = decode_header(blob)
            assert bytes(blob[header.header_len :]) == want
        assert daemon.leases() == 0  # an inline batch copies, then releases at once


async def test_an_error_from_the_engine_is_an_error_frame_with_the_request_id() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        meta, size = put_meta()
        ref = answer(await client.request(Op.PUT, meta, os.urandom(size)), PutAnswer).ref
        ref.state_id = bytes(16)
        missing = await client.request(Op.LOAD, load_meta(ref=ref))
        assert missing.is_error and missing.meta["code"] == 200
        short = await client.request(Op.PUT, put_meta(layer=3)[0], b"too short")
        assert short.is_error and short.meta["code"] in (410, 101)
        assert (await client.request(Op.PING)).op is Op.PONG


async def test_stats_include_the_daemons_own_counters() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        stats = await client.request(Op.STATS)
        assert stats.op is Op.REPLY
        assert stats.meta["daemon"]["connections"] == 1
        assert stats.meta["daemon"]["inflight_requests"] == 1  # this STATS request itself
        assert stats.meta["leases"] == 0


async def test_lookup_release_inspect_verify_delete_over_the_wire() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        refs = []
        for layer in (0, 1):
            meta, size = put_meta(layer)
            refs.append(answer(await client.request(Op.PUT, meta, os.urandom(size)), PutAnswer).ref)
        lookup = answer(await client.request(Op.LOOKUP, LookupMeta(NS.digest, ((16, bytes(32)),), (0, 1))),
                        LookupReply)
        assert lookup.tokens == 16
        assert sorted(ref.state_id for ref, _ in lookup.objects) == sorted(r.state_id for r in refs)
        leases = [lease for _, lease in lookup.objects]
        assert daemon.leases() == 2
        released = await client.request(Op.RELEASE, ReleaseMeta(tuple(leases) + (999_999,)))
        assert answer(released, ReleaseReply).released == 2 and daemon.leases() == 0

        inspected = await client.request(Op.INSPECT, {"state_id": refs[0].state_id.hex()})
        assert inspected.meta["tiers"] == ["host"] and inspected.meta["header"]["layer"] == 0
        verified = await client.request(Op.VERIFY)
        assert verified.meta == {"checked": 2, "dropped": 0, "misfiled": 0, "unknown_key": 0, "by_reason": {}}
        deleted = await client.request(Op.DELETE, {"ref": ref_to_wire(ref_of(refs[1]))})
        assert deleted.meta == {"deleted": 1}
        gone = await client.request(Op.LOAD, load_meta(ref=refs[1]))
        assert gone.is_error and gone.meta["code"] == 200


# -- backpressure -----------------------------------------------------------------------


async def test_the_inflight_cap_stops_reading_instead_of_queueing() -> None:
    limits = {"max_inflight_per_connection": 2, "byte_budget": 1 << 20, "busy_wait_seconds": 60}
    async with running_daemon(limits=limits) as daemon:
        budget = daemon.server.budget
        await budget.acquire(budget.limit)  # every PUT now waits for budget
        client = await connected(daemon)
        sizes = {}
        for request_id in (1, 2, 3):
            meta, size = put_meta(layer=request_id)
            sizes[request_id] = size
            client.send(Frame(Op.PUT, request_id, meta, os.urandom(size)))
        client.send(Frame(Op.PING, 4, {}))
        await eventually(lambda: budget.waiting == 2)  # both running PUTs wait for budget
        stats = daemon.server.stats()
        assert stats["inflight_requests"] == 2 and stats["connections_reading_paused"] == 1
        budget.release(budget.limit)
        answered = [await client.recv() for _ in range(4)]
        assert sorted(f.request_id for f in answered) == [1, 2, 3, 4]
        assert all(not f.is_error for f in answered)
        assert daemon.server.stats()["connections_reading_paused"] == 0


async def test_busy_after_the_bounded_budget_wait() -> None:
    limits = {"byte_budget": 1 << 20, "busy_wait_seconds": 0.05}
    async with running_daemon(limits=limits) as daemon:
        budget = daemon.server.budget
        await budget.acquire(budget.limit - 100)
        client = await connected(daemon)
        meta, size = put_meta()
        busy = await client.request(Op.PUT, meta, os.urandom(size))
        assert busy.is_error and busy.meta["code"] == 302
        assert metric(daemon.metrics, "statetier_busy_total") == 1
        budget.release(budget.limit - 100)
        assert (await client.request(Op.PUT, meta, os.urandom(size))).op is Op.REPLY


async def test_a_payload_larger_than_the_whole_budget_is_invalid() -> None:
    async with running_daemon(limits={"byte_budget": 1024}) as daemon:
        client = await connected(daemon)
        meta, size = put_meta()
        error = await client.request(Op.PUT, meta, os.urandom(size))
        assert error.is_error and error.meta["code"] == 410 and "whole byte budget" in error.meta["message"]


async def scenario_a_slow_reader_keeps_the_lease_until_the_transport_let_go() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        meta, size = put_meta(shape=(8192, 1024))  # 16 MiB: far more than the socket buffers
        payload = os.urandom(size)
        put = answer(await client.request(Op.PUT, meta, payload), PutAnswer)
        client.send(Frame(Op.LOAD, 9, load_meta(ref=put.ref)))
        head = await client.reader.readexactly(HEADER_SIZE)  # the reply has been written...
        # ...but most of it still sits in the daemon's transport: the lease must hold.
        assert daemon.leases() == 1
        length = struct.unpack_from("<I", head)[0]
        rest = await client.reader.readexactly(length + 4 - HEADER_SIZE)
        frame = client._decoder.feed(head + rest)[0]
        assert frame.request_id == 9 and bytes(frame.data[-len(payload) :]) == payload
        await eventually(lambda: daemon.leases() == 0)


async def test_a_slow_reader_keeps_the_lease_until_the_transport_let_go() -> None:
    await scenario_a_slow_reader_keeps_the_lease_until_the_transport_let_go()


def test_a_slow_reader_keeps_the_lease_until_the_transport_let_go_on_uvloop() -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario_a_slow_reader_keeps_the_lease_until_the_transport_let_go())


# -- disconnects, GOODBYE, shutdown ---------------------------------------------------------


async def test_a_client_gone_mid_request_cancels_it_and_releases_its_leases() -> None:
    async with running_daemon(limits={"byte_budget": 4 << 20, "busy_wait_seconds": 60}) as daemon:
        client = await connected(daemon)
        meta, size = put_meta(shape=(1024, 1024))
        put = answer(await client.request(Op.PUT, meta, os.urandom(size)), PutAnswer)
        budget = daemon.server.budget
        await budget.acquire(budget.limit)
        # The load takes its lease, then waits for budget to send the payload.
        client.send(Frame(Op.LOAD, 5, load_meta(ref=put.ref)))
        await eventually(lambda: daemon.leases() == 1 and budget.waiting == 1)
        await client.close()
        await eventually(lambda: daemon.server.stats()["connections"] == 0)
        assert daemon.leases() == 0 and budget.waiting == 0 and budget.in_use == budget.limit


async def test_leases_a_client_never_released_go_when_it_disconnects() -> None:
    async with running_daemon() as daemon:
        client = await connected(daemon)
        meta, size = put_meta()
        put = answer(await client.request(Op.PUT, meta, os.urandom(size)), PutAnswer)
        lookup = answer(await client.request(Op.LOOKUP, LookupMeta(NS.digest, ((16, bytes(32)),), (0,))), LookupReply)
        assert [ref for ref, _ in lookup.objects] == [put.ref]
        assert daemon.leases() == 1
        await client.close()
        await eventually(lambda: daemon.server.stats()["connections"] == 0)
        assert daemon.leases() == 0


async def test_goodbye_answers_what_was_received_then_closes() -> None:
    async with running_daemon(limits={"byte_budget": 1 << 20, "busy_wait_seconds": 60}) as daemon:
        budget = daemon.server.budget
        await budget.acquire(budget.limit)
        client = await connected(daemon)
        meta, size = put_meta()
        client.send(Frame(Op.PUT, 1, meta, os.urandom(size)))
        client.send(Frame(Op.GOODBYE, 0, {}))
        client.send(Frame(Op.PING, 2, {}))  # after GOODBYE: never read
        await eventually(lambda: budget.waiting == 1)
        budget.release(budget.limit)
        reply = await client.recv()
        assert reply.request_id == 1 and reply.op is Op.REPLY
        assert await client.recv() is None


async def test_shutdown_cancels_what_outlives_the_grace_and_says_goodbye() -> None:
    limits = {"byte_budget": 1 << 20, "busy_wait_seconds": 60}
    async with running_daemon(limits=limits) as daemon:
        budget = daemon.server.budget
        await budget.acquire(budget.limit)
        client = await connected(daemon)
        quick = await connected(daemon)
        meta, size = put_meta()
        client.send(Frame(Op.PUT, 1, meta, os.urandom(size)))
        await eventually(lambda: budget.waiting == 1)
        await daemon.server.shutdown(grace=0.05)
        goodbye = await client.recv()
        assert goodbye.op is Op.GOODBYE and goodbye.meta == {"reason": "shutdown"}
        assert await client.recv() is None
        assert (await quick.recv()).op is Op.GOODBYE
        assert not os.path.exists(daemon.socket_path)
        stats = daemon.server.stats()
        assert stats["connections"] == 0 and stats["budget_waiters"] == 0
        with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
            await asyncio.open_unix_connection(daemon.socket_path)


# -- the socket file ----------------------------------------------------------------------


async def test_the_socket_gets_its_mode() -> None:
    async with running_daemon(listen={"socket_mode": 0o600}) as daemon:
        assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o600


async def test_a_stale_socket_file_is_replaced_but_a_live_one_is_not() -> None:
    async with running_daemon() as daemon:
        second = Server(daemon.engine, daemon.config)
        with pytest.raises(ConfigError, match="another process is listening"):
            await second.start()
        assert (await (await connected(daemon)).request(Op.PING)).op is Op.PONG

        stale_path = str(daemon.directory / "stale.sock")
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(stale_path)
        stale.close()  # the file stays, nobody listens
        config = daemon.config.model_copy(
            update={"listen": daemon.config.listen.model_copy(update={"socket_path": stale_path})}
        )
        third = Server(daemon.engine, config)
        await third.start()
        try:
            client = WireClient(*await asyncio.open_unix_connection(stale_path))
            assert (await client.hello()).op is Op.HELLO_OK
        finally:
            await third.shutdown(grace=0)
        assert not os.path.exists(stale_path)


async def test_a_regular_file_at_the_socket_path_is_never_removed() -> None:
    async with running_daemon() as daemon:
        path = daemon.directory / "precious"
        path.write_text("data")
        config = daemon.config.model_copy(
            update={"listen": daemon.config.listen.model_copy(update={"socket_path": path})}
        )
        with pytest.raises(ConfigError, match="not a socket"):
            await Server(daemon.engine, config).start()
        assert path.read_text() == "data"

