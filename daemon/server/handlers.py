"""Request handlers: one coroutine per opcode, from wire meta to an Engine call and back.

- ``Session`` — what a handler may use: the engine, the connection's tenant, its owner
  token for leases, the shared byte budget, the connection's
  shared-memory windows (``daemon/server/windows.py``; ``None`` without), and the daemon's stats.
- ``Reply`` — a handler's answer: meta, data and, for an inline LOAD, a *borrowed*
  payload view plus ``done`` (release the lease) that the connection runs only after the
  transport has given the view back (see ``Connection.send_borrowed``).
- ``handle_*`` — one coroutine per single-object opcode; ``traced`` wraps one with phase
  timings. The batch frames are in ``batch_handlers.py``, the ``Op`` → handler table in
  ``dispatch.py``. Meta is decoded with ``protocol/messages.py`` into ``daemon/requests.py``
  values (``put_request``, ``load_request``); bad meta raises ``InvalidRequest`` naming
  the field. ``place_in_window`` copies a loaded payload into the connection's load window.

Handlers never write to the socket; the connection sends the ``Reply`` or the error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field as dataclass_field

from statetier.daemon.server.budget import ByteBudget
from statetier.daemon.requests import LoadRequest, LookupRequest, PutRequest
from statetier.daemon.trace import TRACE, phase
from statetier.daemon.server.windows import Windows
from statetier.protocol.errors import InvalidRequest
from statetier.protocol.frames import Frame, Op
from statetier.protocol.groups import LayerGroup, check_layers, chosen
from statetier.protocol.identity import Namespace
from statetier.protocol.messages import (
    field,
    key_from_wire,
    provenance_from_wire,
    ref_from_wire,
    ref_to_wire,
    specs_from_wire,
)
from statetier.protocol.sealed import DigestAlg, layout_payload

#: Window copies up to this size run on the loop (a 2 MiB page takes ~0.1 ms); larger ones
#: on the engine's executor.
INLINE_COPY_BYTES = 4 << 20

_DIGESTS = {"blake3": DigestAlg.BLAKE3, "xxh3-128": DigestAlg.XXH3_128}


@dataclass(slots=True)
class Session:
    engine: object
    tenant: str
    owner: object  # the Connection: its leases are released with it
    budget: ByteBudget
    windows: Windows | None  # shared-memory windows passed at HELLO (Unix socket, asked for)
    daemon_stats: Callable[[], dict]
    max_frame: int = 65 << 20  # the largest reply frame this connection sends

    @property
    def shm(self) -> bool:
        return self.windows is not None


@dataclass(slots=True)
class Reply:
    meta: dict
    data: bytes | memoryview = b""
    op: Op = Op.REPLY
    kind: str = "none"  # metric label: "kv", "ssm" or "none"
    borrowed: bool = False  # data must stay valid until the transport gives it back
    hold_bytes: int = 0  # bytes of ``data`` held under the byte budget while sending
    done: Callable[[], Awaitable[object]] | None = dataclass_field(default=None)
    items: list[tuple[str, str]] | None = None  # a batch: (kind, op) of each item that succeeded


Handler = Callable[[Session, Frame], Awaitable[Reply]]


def kind_of(key) -> str:
    return key.kind.name.lower()


def _namespace(meta: dict) -> Namespace:
    return Namespace.from_hex(field(meta, "ns", str))


def _int_list(meta: dict, name: str) -> tuple[int, ...]:
    items = field(meta, name, list, default=[])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise InvalidRequest(f"field {name!r} must be a list of integers")
    return tuple(items)


def _put_request(tenant: str, meta: dict) -> PutRequest:
    digest = field(meta, "digest", str, default="blake3")
    if digest not in _DIGESTS:
        raise InvalidRequest(f"field 'digest' must be one of {sorted(_DIGESTS)}")
    return PutRequest(
        tenant=tenant,
        key=key_from_wire(field(meta, "key", dict)),
        provenance=provenance_from_wire(field(meta, "provenance", dict)),
        specs=specs_from_wire(field(meta, "tensors", list)),
        publish=field(meta, "publish", bool, default=False),
        version=field(meta, "version", int, optional=True),
        speculative=field(meta, "speculative", bool, default=False),
        digest_alg=_DIGESTS[digest],
        durable=field(meta, "durable", bool, default=False),
    )


def _put_reply(result) -> dict:
    return {"ref": ref_to_wire(result.ref), "tier": result.tier, "published": result.published,
            "durable": result.durable}


async def handle_ping(session: Session, frame: Frame) -> Reply:
    return Reply({}, op=Op.PONG)


def traced(handler: Handler) -> Handler:
    """Run ``handler`` with phase timings when the request asks (``"trace": true``); the
    reply then says, in µs, how long the daemon worked on it and in which phases."""
    async def run(session: Session, frame: Frame) -> Reply:
        if frame.meta.get("trace") is not True:
            return await handler(session, frame)
        timings: dict = {}
        token = TRACE.set(timings)
        started = time.perf_counter()
        try:
            reply = await handler(session, frame)
        finally:
            TRACE.reset(token)
        timings["daemon"] = (time.perf_counter() - started) * 1e6
        reply.meta["trace"] = timings
        return reply
    return run


async def handle_put(session: Session, frame: Frame) -> Reply:
    """Inline (the payload is ``data``) or from the put window (``window``: its offset)."""
    request = _put_request(session.tenant, frame.meta)
    window = field(frame.meta, "window", int, optional=True)
    if window is None:
        async with session.budget.hold(len(frame.data)):
            result = await session.engine.put(request, frame.data)
    else:
        if session.windows is None:
            raise InvalidRequest("a PUT from a window needs the shared-memory windows of HELLO_OK")
        nbytes = layout_payload(request.specs).payload_len
        source = session.windows.put_view(window, nbytes)
        async with session.budget.hold(nbytes):
            result = await session.engine.put_shared(request, source)
    return Reply(_put_reply(result), kind=kind_of(request.key))


async def put_one(session: Session, meta: dict, payload) -> dict:
    request = _put_request(session.tenant, meta)
    if payload is not None:
        result = await session.engine.put(request, payload)
    else:
        window = field(meta, "window", int)
        if session.windows is None:
            raise InvalidRequest("a PUT from a window needs the shared-memory windows of HELLO_OK")
        source = session.windows.put_view(window, layout_payload(request.specs).payload_len)
        result = await session.engine.put_shared(request, source)
    return _put_reply(result)


def load_request(tenant: str, meta: dict) -> LoadRequest:
    ref_meta = field(meta, "ref", dict, optional=True)
    key_meta = field(meta, "key", dict, optional=True)
    if (ref_meta is None) == (key_meta is None):
        raise InvalidRequest("LOAD needs exactly one of 'ref' and 'key'")
    tensors = field(meta, "tensors", list, optional=True)
    ref = ref_from_wire(ref_meta) if ref_meta is not None else None
    key = key_from_wire(key_meta) if key_meta is not None else None
    layers = _int_list(meta, "layers") if field(meta, "layers", list, optional=True) is not None else None
    if layers is not None:
        check_layers(ref.key if ref is not None else key, layers)
    return LoadRequest(
        tenant=tenant,
        namespace=_namespace(meta),
        ref=ref,
        key=key,
        tensors=specs_from_wire(tensors) if tensors is not None else None,
        allow_speculative=field(meta, "speculative", bool, default=False),
        full_check=field(meta, "recheck", bool, default=False),
        layers=layers,
    )


def chosen_regions(result, layers: tuple[int, ...] | None) -> list[memoryview]:
    """The payload regions a load sends: all of them as one view, or a group object's chosen
    layers' regions, in payload order (the client lays them out the same way)."""
    if layers is None:
        return [result.payload]
    return [result.payload[t.offset : t.offset + t.region] for t in chosen(result.header.tensors, layers)]


async def handle_load(session: Session, frame: Frame) -> Reply:
    """The stored object's signed header and payload: both in ``data`` (inline), or the
    header in ``data`` and the payload copied into a region of the load window.

    The daemon has checked the header (signature, identity, version); the client checks
    the payload against the header's digests where it lands (DESIGN §6).
    """
    request = load_request(session.tenant, frame.meta)
    wants_shm = field(frame.meta, "shm", bool, default=False)
    engine, owner = session.engine, session.owner
    result = await engine.load(request, owner)
    released = False
    try:
        kind = kind_of(result.header.key)
        meta = {"tier": result.tier}
        regions = chosen_regions(result, request.layers)
        if wants_shm and session.windows is not None:
            placed = await place_in_window(session, regions)
            if placed is not None:
                header = bytes(result.blob[: result.header.header_len])
                released = True
                await engine.release(result.lease_id, owner)
                meta.update(window=placed[1], region=placed[0])
                return Reply(meta, header, kind=kind)
        if request.layers is not None:  # a group object's chosen layers: header and regions, copied
            data = b"".join([result.blob[: result.header.header_len], *regions])
            released = True
            await engine.release(result.lease_id, owner)
            return Reply(meta, data, kind=kind)
        blob = memoryview(result.blob).cast("B")

        async def release() -> None:
            await engine.release(result.lease_id, owner)

        released = True
        return Reply(meta, blob, kind=kind, borrowed=True, hold_bytes=blob.nbytes, done=release)
    except BaseException:
        if not released:
            await engine.release(result.lease_id, owner)
        raise


async def place_in_window(session: Session, parts: list[memoryview]) -> tuple[int, int] | None:
    """Copy ``parts`` back to back into a fresh load-window region: (region id, offset), or
    None when the window has no room (the reply then carries the payload inline)."""
    nbytes = sum(part.nbytes for part in parts)
    placed = session.windows.place(nbytes)
    if placed is None:
        return None
    region_id, offset, dest = placed
    try:
        with phase("window_copy"):
            if nbytes <= INLINE_COPY_BYTES or session.engine.executor is None:
                _copy(dest, parts)
            else:
                await asyncio.get_running_loop().run_in_executor(session.engine.executor, _copy, dest, parts)
    except BaseException:
        session.windows.free(region_id)
        raise
    return region_id, offset


def _copy(dest: memoryview, parts: list[memoryview]) -> None:
    at = 0
    for part in parts:
        dest[at : at + part.nbytes] = part
        at += part.nbytes


async def handle_release(session: Session, frame: Frame) -> Reply:
    """Leases (from LOOKUP) and load-window regions (``regions``) given back."""
    released = 0
    for lease_id in _int_list(frame.meta, "leases"):
        released += bool(await session.engine.release(lease_id, session.owner))
    regions = _int_list(frame.meta, "regions")
    if regions and session.windows is not None:
        released += sum(session.windows.free(region) for region in regions)
    return Reply({"released": released})


def _boundaries(meta: dict) -> tuple[tuple[int, bytes], ...]:
    out = []
    for item in field(meta, "boundaries", list):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                and not isinstance(item[0], bool) and isinstance(item[1], str)):
            raise InvalidRequest("each boundary must be [token_end, prefix_hash_hex]")
        try:
            out.append((item[0], bytes.fromhex(item[1])))
        except ValueError:
            raise InvalidRequest("a boundary's prefix hash must be hex") from None
    return tuple(out)


def _tp_size(meta: dict) -> int:
    tp_size = field(meta, "tp_size", int, default=1)
    if not 1 <= tp_size <= 4096:
        raise InvalidRequest("field 'tp_size' must be between 1 and 4096")
    return tp_size


async def handle_lookup(session: Session, frame: Frame) -> Reply:
    meta = frame.meta
    kv_layout = field(meta, "kv_layout", str, default="blocks")
    if kv_layout not in ("blocks", "prefix"):
        raise InvalidRequest("field 'kv_layout' must be 'blocks' or 'prefix'")
    request = LookupRequest(
        tenant=session.tenant,
        namespace=_namespace(meta),
        attention_layers=_int_list(meta, "attention_layers"),
        ssm_layers=_int_list(meta, "ssm_layers"),
        boundaries=_boundaries(meta),
        kv_layout=kv_layout,
        shards=tuple(range(_tp_size(meta))),
        lease=field(meta, "lease", bool, default=True),
        groups=tuple(LayerGroup.from_wire(item) for item in field(meta, "groups", list, default=[])),
    )
    result = await session.engine.lookup(request, session.owner)
    objects = [{"ref": ref_to_wire(ref), "lease": lease} for ref, lease in result.objects]
    return Reply({"tokens": result.tokens, "objects": objects})


async def handle_delete(session: Session, frame: Frame) -> Reply:
    ref = ref_from_wire(field(frame.meta, "ref", dict))
    deleted = await session.engine.delete(session.tenant, ref)
    return Reply({"deleted": deleted}, kind=kind_of(ref.key))


async def handle_stats(session: Session, frame: Frame) -> Reply:
    stats = dict(session.engine.stats())
    stats["daemon"] = session.daemon_stats()
    return Reply(stats)


async def handle_inspect(session: Session, frame: Frame) -> Reply:
    text = field(frame.meta, "state_id", str)
    try:
        state_id = bytes.fromhex(text)
    except ValueError:
        raise InvalidRequest("field 'state_id' must be hex") from None
    return Reply(await session.engine.inspect(session.tenant, state_id))


async def handle_verify(session: Session, frame: Frame) -> Reply:
    return Reply(await session.engine.verify_all(session.tenant))
