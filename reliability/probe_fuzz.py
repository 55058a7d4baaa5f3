"""Probe 2, frame and header fuzzing: mutated frames and random bytes against a running
daemon from many connections, while a well-behaved client keeps putting and loading.

Inputs, each one frame (or one blob of bytes) sent to the daemon:

- request mutations on a live connection: a valid request of every op (PUT with its
  tensors, PUT_BATCH, LOAD by ref and by key, LOAD_BATCH, LOOKUP, DELETE, RELEASE, STATS,
  INSPECT, LIST, PURGE (of a namespace or tenant with nothing stored), PING) with 1–3 of: a
  field dropped, replaced by a value of another type (huge, negative, long or non-text
  strings, bytes of every length, nested arrays and maps), an element added, a tensor spec
  bent (dtype, rank, dims, names), the payload made longer or shorter than the specs,
  request id 0 or repeated; the hot ops' binary metas mutated as MessagePack arrays, the
  admin ops' as JSON; 32 pipelined per batch;
- frame mutations (last in a batch, or instead of HELLO): length prefix, opcode, flags,
  reserved field, meta_len, bytes flipped in header or meta, meta that is not JSON, a frame
  cut short, an oversized length;
- random bytes of random length as a connection's first input.

Sealed headers never come from a client (the daemon seals); mutated and forged sealed
headers are stored objects, probed where they live: ``probe_corruption`` (segments,
Redis chunks) and ``probe_security`` (a keyless writer forging them in Redis).

- crash: the daemon process exits. hang: an input neither answered nor its connection
  closed within 10 s.
- wrong: the well-behaved client's put or load fails or returns other bytes.
- internal error: a traceback in the daemon's log or an ``internal`` error reply — an input
  that met an untyped failure instead of a typed error.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import time

import msgspec

from harness import Budget, DaemonProcess, ProbeResult, Promise, internal_errors, key_prefix, passed, payload
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import StatetierError
from statetier.protocol.frames import (
    FLAG_BINARY,
    PROTOCOL_VERSIONS,
    Frame,
    FrameDecoder,
    Op,
    encode_frame_bytes,
    hello_frame,
)
from statetier.protocol.identity import Kind, NamespaceSpec, StateKey
from statetier.protocol.messages import ref_from_wire
from statetier.protocol.wire_meta import (
    LoadBatchMeta,
    LoadMeta,
    LookupMeta,
    Origin,
    PutBatchMeta,
    PutMeta,
    ReleaseMeta,
    encode,
    wire_key,
    wire_ref,
    wire_specs,
)
from wire import Wire

PROBE = "fuzz"
PROMISE = Promise(
    "malformed frames and headers from many connections never crash or hang the daemon, "
    "each gets a typed error or a closed connection, and other clients are unaffected",
    lost_means="(nothing is stored by the fuzzer) the well-behaved client's object not loadable",
    wrong_means="the well-behaved client's put/load failing or returning other bytes during the fuzzing",
)
FUZZERS = 8
BATCH = 32
REPLY_TIMEOUT = 10.0
NS = NamespaceSpec(model_id=PROBE).namespace()
_HEADER = struct.Struct("<IBBHQI")
_ODD_STRINGS = ["", "x" * 70000, "\udc80", "\ud800x", "\x00\n\x1b[31m", "é" * 300, "kv", "float16",
                "bfloat16", "ssm", "0" * 64, "ff" * 16, "../../etc/passwd", "NaN"]


def _odd_value(rng: random.Random, depth: int = 0):
    pick = rng.randrange(11)
    if pick == 0:
        return rng.choice([0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 10**30, 7])
    if pick == 1:
        return rng.choice(_ODD_STRINGS)
    if pick == 2:
        return rng.choice([True, False, None])
    if pick == 3:
        return rng.choice([0.5, -1e308, 1e308, 3.0])
    if pick == 4 and depth < 3:
        return [_odd_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 5 and depth < 3:
        return {rng.choice(["a", "key", "ref", "ns", ""]): _odd_value(rng, depth + 1) for _ in range(rng.randrange(3))}
    if pick == 6:
        return [[rng.choice(_ODD_STRINGS), rng.choice(["uint8", "float16", "bogus", 7]),
                 [rng.choice([0, 1, -1, 2**40, 16]) for _ in range(rng.randrange(0, 12))]]]
    if pick == 7:
        return list(range(rng.randrange(2000)))
    if pick == 8:
        return rng.randbytes(rng.randrange(1, 40)).hex()
    return rng.randrange(-5, 100000)


def _paths(meta, prefix=()):
    yield prefix
    if isinstance(meta, dict):
        for name, value in meta.items():
            yield from _paths(value, prefix + (name,))
    elif isinstance(meta, list):
        for index, value in enumerate(meta[:8]):
            yield from _paths(value, prefix + (index,))


def _bend(value, rng: random.Random) -> None:
    """1–3 places of ``value`` (nested maps and arrays) bent in place: an entry dropped, one
    added, or one replaced by a value of another type (bytes of another length too)."""
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(list(_paths(value))[1:] or [()])
        if not path:
            if isinstance(value, dict):
                value[rng.choice(["extra", "zz", "ref", "key"])] = _odd_value(rng)
            continue
        parent = value
        for step in path[:-1]:
            parent = parent[step]
        action = rng.randrange(4)
        if action == 0:
            del parent[path[-1]]
        elif action == 1:
            if isinstance(parent, dict):
                parent["unknown_" + str(rng.randrange(9))] = _odd_value(rng)
            else:
                parent.append(_odd_value(rng))
        elif action == 2:
            parent[path[-1]] = rng.randbytes(rng.choice([0, 1, 15, 16, 31, 32, 33, 200]))
        else:
            parent[path[-1]] = _odd_value(rng)


def _mutate_meta(meta: dict, rng: random.Random) -> dict:
    """A JSON meta (an admin op's, HELLO) with 1–3 places bent (bytes as hex: JSON has none)."""
    meta = json.loads(json.dumps(meta))
    _bend(meta, rng)
    return json.loads(json.dumps(meta, default=bytes.hex))


def _mutate_binary(meta, rng: random.Random) -> bytes:
    """A hot op's typed meta as its MessagePack array with 1–3 places bent; the bytes to
    send as the frame's meta (``FLAG_BINARY``). A value MessagePack cannot carry (a lone
    surrogate, an integer past u64) leaves the meta unbent."""
    value = msgspec.to_builtins(meta, builtin_types=(bytes,))
    _bend(value, rng)
    try:
        return msgspec.msgpack.encode(value)
    except (msgspec.EncodeError, OverflowError, UnicodeEncodeError, TypeError):
        return encode(meta)


ADMIN_SHARE = 0.01


class Templates:
    """Valid requests of every op, with refs of objects that exist."""

    def __init__(self, refs: list[dict]) -> None:
        self.refs = refs

    def request(self, rng: random.Random) -> tuple[Op, object, bytes, int]:
        """(op, meta, data, flags): a hot op's meta as MessagePack bytes (``FLAG_BINARY``),
        an admin op's as a JSON dict."""
        size = rng.choice([1, 16, 1000, 4096])
        key = wire_key(StateKey(NS, Kind.KV, rng.randrange(4), key_prefix(PROBE, rng.randrange(1 << 30)), 0, 16))
        ref_dict = rng.choice(self.refs)
        ref = wire_ref(ref_from_wire(ref_dict))
        spec = wire_specs([TensorSpec("kv", "uint8", (size,))])
        choices = [
            (Op.PUT, PutMeta(key, Origin("fz"), spec), bytes(size + rng.choice([0, 0, 0, -1, 1, 64]) if size > 1 else size)),
            (Op.LOAD, LoadMeta(NS.digest, ref=ref), b""),
            (Op.LOAD, LoadMeta(NS.digest, key=ref.key), b""),
            (Op.LOOKUP, LookupMeta(NS.digest, ((16, ref.key.prefix),), (0, 1), kv_layout="prefix", lease=False), b""),
            (Op.DELETE, {"ref": ref_dict}, b""),
            (Op.RELEASE, ReleaseMeta((rng.randrange(100),)), b""),
            (Op.STATS, {}, b""),
            (Op.INSPECT, {"state_id": ref_dict["state_id"]}, b""),
            (Op.PING, {}, b""),
            (Op.PUT_BATCH, PutBatchMeta((PutMeta(key, Origin("fz"), spec, data_len=size),)), bytes(size)),
            (Op.LOAD_BATCH, LoadBatchMeta(NS.digest, (LoadMeta(ref=ref), LoadMeta(key=ref.key))), b""),
        ]
        if rng.random() < ADMIN_SHARE:  # each walks every stored object: a few, not a twelfth of the inputs
            choices = [(Op.LIST, {"all": rng.random() < 0.5}, b""),
                       # purges that, unbent, remove nothing the well-behaved client stored
                       (Op.PURGE, {"ns": rng.randbytes(32).hex()}, b""),
                       (Op.PURGE, {"tenant": "fz-nobody"}, b"")]
        op, meta, data = rng.choice(choices)
        if isinstance(meta, dict):
            if op is Op.DELETE and rng.random() < 0.9:
                meta = _mutate_meta(meta, rng)  # a valid delete would empty the store: mostly bent
            elif rng.random() < 0.85:
                meta = _mutate_meta(meta, rng)
            return op, meta, data, 0
        return op, _mutate_binary(meta, rng) if rng.random() < 0.85 else encode(meta), data, FLAG_BINARY


def _frame_mutation(rng: random.Random, valid: bytes) -> bytes:
    raw = bytearray(valid)
    kind = rng.randrange(9)
    length, op, flags, reserved, request_id, meta_len = _HEADER.unpack_from(raw, 0)
    if kind == 0:
        _HEADER.pack_into(raw, 0, max(0, length + rng.choice([-5, -1, 1, 7, 1000])), op, flags, reserved, request_id, meta_len)
    elif kind == 1:
        _HEADER.pack_into(raw, 0, length, rng.randrange(256), flags, reserved, request_id, meta_len)
    elif kind == 2:
        _HEADER.pack_into(raw, 0, length, op, rng.randrange(1, 256), reserved, request_id, meta_len)
    elif kind == 3:
        _HEADER.pack_into(raw, 0, length, op, flags, rng.randrange(1, 65536), request_id, meta_len)
    elif kind == 4:
        _HEADER.pack_into(raw, 0, length, op, flags, reserved, request_id, rng.randrange(0, 1 << 32))
    elif kind == 5:
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif kind == 6:
        raw = raw[: rng.randrange(1, len(raw))]
    elif kind == 7:
        body = rng.randbytes(rng.randrange(1, 200))
        raw = bytearray(_HEADER.pack(16 + len(body), op, 0, 0, request_id, len(body)) + body)
    else:
        _HEADER.pack_into(raw, 0, rng.choice([0, 1, 15, 0xFFFFFFFF, 1 << 30]), op, flags, reserved, request_id, meta_len)
    return bytes(raw)


async def _read_replies(reader: asyncio.StreamReader, expected: int, deadline: float) -> tuple[int, int, bool]:
    """Replies read, internal-error replies, and whether the connection closed."""
    decoder, got, internal = FrameDecoder(64 << 20), 0, 0
    while got < expected:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError
        data = await asyncio.wait_for(reader.read(1 << 20), remaining)
        if not data:
            return got, internal, True
        for frame in decoder.feed(data):
            got += 1
            internal += frame.is_error and frame.meta.get("reason") == "internal"
    return got, internal, False


async def _fuzzer(url_path: str, templates: Templates, rng: random.Random, deadline: float, cap: int,
                  result: ProbeResult) -> None:
    while result.inputs < cap and not passed(deadline):
        try:
            reader, writer = await asyncio.open_unix_connection(url_path)
        except OSError as exc:
            result.fail(f"connect failed: {exc}")
            await asyncio.sleep(0.1)
            continue
        try:
            hello = encode_frame_bytes(hello_frame(PROTOCOL_VERSIONS, tenant="default", client="fuzz"))
            if rng.random() < 0.12:  # a bad first input: the connection's only one
                first = rng.choice([os.urandom(rng.randrange(1, 4096)), _frame_mutation(rng, hello),
                                    encode_frame_bytes(Frame(Op.HELLO, 1, _mutate_meta({"versions": list(PROTOCOL_VERSIONS), "tenant": "default",
                                                                                       "token": "t", "shm": False}, rng)))])
                writer.write(first)
                writer.write_eof()  # a frame cut short must end somewhere: at our EOF
                result.inputs += 1
                await _read_replies(reader, 1, time.monotonic() + REPLY_TIMEOUT)
                continue
            writer.write(hello)
            await _read_replies(reader, 1, time.monotonic() + REPLY_TIMEOUT)
            frames = []
            for index in range(BATCH):
                op, meta, data, flags = templates.request(rng)
                request_id = rng.choice([index + 1] * 30 + [0, 1, 2**64 - 1])
                try:
                    frames.append(encode_frame_bytes(Frame(op, request_id, meta, data, flags)))
                except StatetierError:
                    continue
            mutated = rng.random() < 0.3
            if mutated:
                frames.append(_frame_mutation(rng, frames[-1] if frames else hello))
            writer.write(b"".join(frames))
            if mutated:
                writer.write_eof()  # it may be a frame cut short: the daemon waits for the rest
            result.inputs += len(frames)
            got, internal, closed = await _read_replies(reader, len(frames), time.monotonic() + REPLY_TIMEOUT)
            result.internal_errors += internal
        except asyncio.TimeoutError:
            result.hangs += 1
            result.fail("a connection got neither replies nor EOF within 10 s")
        except (ConnectionError, OSError):
            pass  # the daemon reset a connection it refused: an answer too
        finally:
            writer.close()


async def _bystander(url: str, deadline: float, result: ProbeResult) -> None:
    wire = await Wire.open(url, model="bystander")
    try:
        seed = 0
        while not passed(deadline):
            seed += 1
            data = payload(seed, 8192)
            try:
                reply = await wire.put(wire.key(0, key_prefix("bystander", seed)), data, request_id="b")
                ok = await wire.load(ref=reply["ref"]) == data
            except StatetierError as exc:
                ok = False
                result.fail(f"the well-behaved client's round trip failed: {exc!r}")
            result.add("bystander_round_trips")
            if not ok:
                result.wrong += 1
            await asyncio.sleep(0.05)
    finally:
        await wire.close()


async def run(budget: Budget, result: ProbeResult) -> None:
    daemon = DaemonProcess(name="fuzz", host_capacity="64MiB", settings={"limits.max_frame_bytes": "1MiB"})
    try:
        daemon.start()
        wire = await Wire.open(daemon.url, model=PROBE)
        refs = [(await wire.put(wire.key(i % 4, key_prefix(PROBE, -i)), payload(i, 4096), request_id="seed"))["ref"]
                for i in range(16)]
        await wire.close()
        deadline = budget.deadline()
        cap = budget.scale(400_000, 20_000)
        rng = random.Random(1414)
        tasks = [asyncio.create_task(_fuzzer(str(daemon.socket_path), Templates(refs), random.Random(rng.random()),
                                             deadline, cap, result)) for _ in range(FUZZERS)]
        tasks.append(asyncio.create_task(_bystander(daemon.url, deadline, result)))
        await asyncio.gather(*tasks)
        if not daemon.is_running:
            result.crashes += 1
            result.fail("the daemon exited during fuzzing")
        else:
            scrape = daemon.scrape()
            result.internal_errors += int(scrape.value("statetier_errors_total", reason="internal"))
            result.internal_errors = max(result.internal_errors, internal_errors(daemon))
            result.notes["typed_errors_by_reason"] = {
                reason: int(scrape.value("statetier_errors_total", reason=reason))
                for reason in ("invalid_request", "malformed_frame", "frame_too_large", "not_found",
                               "unsupported_protocol", "lease", "forbidden", "unauthorized")}
            if result.internal_errors:
                tail = daemon.log_text()
                at = tail.find("Traceback")
                result.fail("first traceback: " + tail[max(0, at - 300): at + 1500])
        result.faults = result.inputs
    finally:
        daemon.close()
