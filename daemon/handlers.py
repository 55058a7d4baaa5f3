"""Request handlers: one coroutine per opcode, from wire meta to an Engine call and back.

- ``Session`` — what a handler may use: the engine, the connection's tenant, its owner
  token for leases and reservations, the shared byte budget, whether shared memory was
  granted at HELLO, and the daemon's own stats.
- ``Reply`` — a handler's answer: meta, data and, for an inline LOAD, a *borrowed*
  payload view plus ``done`` (release the lease) that the connection runs only after the
  transport has given the view back (see ``Connection.send_borrowed``).
- ``HANDLERS`` — ``Op`` → handler. Meta is decoded with ``protocol/messages.py`` into
  ``daemon/requests.py`` values; bad meta raises ``InvalidRequest`` naming the field.

Handlers never write to the socket; the connection sends the ``Reply`` or the error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field as dataclass_field

from statetier.daemon.budget import ByteBudget
from statetier.daemon.requests import LoadRequest, LookupRequest, PutRequest
from statetier.protocol.errors import InvalidRequest
from statetier.protocol.frames import Frame, Op
from statetier.protocol.identity import Namespace
from statetier.protocol.messages import (
    field,
    header_to_wire,
    key_from_wire,
    provenance_from_wire,
    ref_from_wire,
    ref_to_wire,
    specs_from_wire,
)
from statetier.protocol.sealed import DigestAlg

_DIGESTS = {"blake3": DigestAlg.BLAKE3, "xxh3-128": DigestAlg.XXH3_128}


@dataclass(slots=True)
class Session:
    engine: object
    tenant: str
    owner: object  # the Connection: leases and reservations are released with it
    budget: ByteBudget
    shm: bool  # shared memory granted at HELLO (Unix socket, asked for, host tier present)
    daemon_stats: Callable[[], dict]


@dataclass(slots=True)
class Reply:
    meta: dict
    data: bytes | memoryview = b""
    op: Op = Op.REPLY
    kind: str = "none"  # metric label: "kv", "ssm" or "none"
    borrowed: bool = False  # data must stay valid until the transport gives it back
    hold_bytes: int = 0  # bytes of ``data`` held under the byte budget while sending
    done: Callable[[], Awaitable[object]] | None = dataclass_field(default=None)


Handler = Callable[[Session, Frame], Awaitable[Reply]]


def _kind(key) -> str:
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
    )


async def handle_ping(session: Session, frame: Frame) -> Reply:
    return Reply({}, op=Op.PONG)


async def handle_put(session: Session, frame: Frame) -> Reply:
    request = _put_request(session.tenant, frame.meta)
    async with session.budget.hold(len(frame.data)):
        result = await session.engine.put(request, frame.data)
    return Reply({"ref": ref_to_wire(result.ref), "tier": result.tier, "published": result.published},
                 kind=_kind(request.key))


async def handle_put_reserve(session: Session, frame: Frame) -> Reply:
    if not session.shm:
        raise InvalidRequest("PUT_RESERVE needs shared memory, granted at HELLO on the Unix socket")
    request = _put_request(session.tenant, frame.meta)
    reservation = await session.engine.reserve(request, session.owner)
    layout = reservation.layout
    tensors = [
        [spec.name, spec.dtype, list(spec.shape), offset]
        for spec, offset in zip(layout.specs, layout.offsets)
    ]
    meta = {
        "ticket": reservation.ticket_id,
        "offset": reservation.payload_offset,
        "payload_len": layout.payload_len,
        "tensors": tensors,
    }
    return Reply(meta, kind=_kind(request.key))


async def handle_put_commit(session: Session, frame: Frame) -> Reply:
    result = await session.engine.commit(field(frame.meta, "ticket", int), session.owner)
    return Reply({"ref": ref_to_wire(result.ref), "tier": result.tier, "published": result.published},
                 kind=_kind(result.ref.key))


async def handle_put_abort(session: Session, frame: Frame) -> Reply:
    await session.engine.abort(field(frame.meta, "ticket", int), session.owner)
    return Reply({})


def _load_request(tenant: str, meta: dict) -> LoadRequest:
    ref_meta = field(meta, "ref", dict, optional=True)
    key_meta = field(meta, "key", dict, optional=True)
    if (ref_meta is None) == (key_meta is None):
        raise InvalidRequest("LOAD needs exactly one of 'ref' and 'key'")
    tensors = field(meta, "tensors", list, optional=True)
    return LoadRequest(
        tenant=tenant,
        namespace=_namespace(meta),
        ref=ref_from_wire(ref_meta) if ref_meta is not None else None,
        key=key_from_wire(key_meta) if key_meta is not None else None,
        tensors=specs_from_wire(tensors) if tensors is not None else None,
        allow_speculative=field(meta, "speculative", bool, default=False),
    )


async def handle_load(session: Session, frame: Frame) -> Reply:
    request = _load_request(session.tenant, frame.meta)
    wants_shm = field(frame.meta, "shm", bool, default=False)
    engine, owner = session.engine, session.owner
    result = await engine.load(request, owner)
    try:
        meta = header_to_wire(result.header)
        meta["tier"] = result.tier
        kind = _kind(result.header.key)
        if wants_shm and session.shm and result.arena_offset is not None:
            # The client reads the arena itself and sends RELEASE (or disconnects).
            meta.update(lease=result.lease_id, offset=result.arena_offset)
            return Reply(meta, kind=kind)
        meta.update(lease=None, offset=None)
        payload = memoryview(result.payload).cast("B")

        async def release() -> None:
            await engine.release(result.lease_id, owner)

        return Reply(
            meta, payload, kind=kind, borrowed=True, hold_bytes=payload.nbytes, done=release
        )
    except BaseException:
        await engine.release(result.lease_id, owner)
        raise


async def handle_release(session: Session, frame: Frame) -> Reply:
    released = 0
    for lease_id in _int_list(frame.meta, "leases"):
        released += bool(await session.engine.release(lease_id, session.owner))
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
    )
    result = await session.engine.lookup(request, session.owner)
    objects = [{"ref": ref_to_wire(ref), "lease": lease} for ref, lease in result.objects]
    return Reply({"tokens": result.tokens, "objects": objects})


async def handle_delete(session: Session, frame: Frame) -> Reply:
    ref = ref_from_wire(field(frame.meta, "ref", dict))
    deleted = await session.engine.delete(session.tenant, ref)
    return Reply({"deleted": deleted}, kind=_kind(ref.key))


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


HANDLERS: dict[Op, Handler] = {
    Op.PING: handle_ping,
    Op.PUT: handle_put,
    Op.PUT_RESERVE: handle_put_reserve,
    Op.PUT_COMMIT: handle_put_commit,
    Op.PUT_ABORT: handle_put_abort,
    Op.LOAD: handle_load,
    Op.RELEASE: handle_release,
    Op.LOOKUP: handle_lookup,
    Op.DELETE: handle_delete,
    Op.STATS: handle_stats,
    Op.INSPECT: handle_inspect,
    Op.VERIFY: handle_verify,
}
