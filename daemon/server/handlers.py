"""Request handlers: one coroutine per opcode, from wire meta to an Engine call and back.

- ``Session`` — what a handler may use: the engine, the connection's tenant, its owner
  token for leases, the shared byte budget, the connection's
  shared-memory windows (``daemon/server/windows.py``; ``None`` without), and the daemon's stats.
- ``Reply`` — a handler's answer: meta, data and, for an inline LOAD, a *borrowed*
  payload view plus ``done`` (release the lease) that the connection runs only after the
  transport has given the view back (``RequestRunner``: the writer's ``wait_flushed``).
- ``hot(cls, handler)`` — a hot op's handler (PUT, PUT_BATCH, LOAD, LOAD_BATCH, LOOKUP,
  RELEASE): its binary meta decoded into the ``protocol.wire_meta`` Struct ``cls``, regions
  given back in passing freed, phase timings when asked; the handler gets ``(session,
  meta, data)`` and answers a Struct.
- ``handle_*`` — the coroutines of LOOKUP and RELEASE (hot), PING, and the admin ops (JSON
  meta, decoded with ``protocol/messages.py``). Puts are in ``put_handlers.py``, loads in
  ``load_handlers.py``, the ``Op`` → handler table in ``dispatch.py``. Bad meta raises
  ``InvalidRequest`` naming the field.

Handlers never write to the socket; the connection sends the ``Reply`` or the error.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field as dataclass_field
from typing import Any

from msgspec import Struct

from statetier.daemon.server.budget import ByteBudget
from statetier.daemon.server.engine_calls import EngineCalls
from statetier.daemon.requests import LookupRequest
from statetier.daemon.trace import TRACE
from statetier.daemon.server.windows import Windows
from statetier.protocol.errors import Forbidden, InvalidRequest
from statetier.protocol.frames import Frame, FrameData, Op
from statetier.protocol.groups import LayerGroup
from statetier.protocol.identity import Kind, Namespace
from statetier.protocol.messages import field, ref_from_wire
from statetier.protocol.wire_meta import LookupMeta, LookupReply, ReleaseMeta, ReleaseReply, decode, wire_ref


@dataclass(slots=True)
class Session:
    engine: EngineCalls
    tenant: str
    owner: object  # the Connection: its leases are released with it
    budget: ByteBudget
    windows: Windows | None  # shared-memory windows passed at HELLO (Unix socket, asked for)
    daemon_stats: Callable[[], dict]
    max_frame: int = 65 << 20  # the largest reply frame this connection sends
    is_operator: bool = False  # a Unix peer in listen.operator_uids: LIST and PURGE across tenants
    verify_progress: tuple[int, int] | None = None  # (done, total) while this connection's VERIFY runs

    @property
    def shm(self) -> bool:
        return self.windows is not None


@dataclass(slots=True)
class Reply:
    meta: Any  # a JSON object (dict), or a hot op's wire_meta Struct
    data: FrameData = b""
    op: Op = Op.REPLY
    kind: str = "none"  # metric label: "kv", "ssm" or "none"
    borrowed: bool = False  # data must stay valid until the transport gives it back
    hold_bytes: int = 0  # bytes of ``data`` held under the byte budget while sending
    done: Callable[[], Awaitable[object]] | None = dataclass_field(default=None)
    items: list[tuple[str, str]] | None = None  # a batch: (kind, op) of each item that succeeded


Handler = Callable[[Session, Frame], Awaitable[Reply]]
HotHandler = Callable[[Session, Any, FrameData], Awaitable[Reply]]  # (session, typed meta, data)


def kind_of(key) -> str:
    return key.kind.name.lower()


async def handle_ping(session: Session, frame: Frame) -> Reply:
    return Reply({}, op=Op.PONG)


def hot(cls: type[Struct], handler: HotHandler) -> Handler:
    """A hot op's handler (``wire_meta.REQUESTS``): its meta decoded into ``cls`` (binary
    only: ``InvalidRequest`` for a JSON meta), the load-window regions it gives back in
    passing freed, and phase timings when it asks (``trace``): the reply then says, in µs,
    how long the daemon worked on it and in which phases."""
    async def run(session: Session, frame: Frame) -> Reply:
        if not frame.is_binary:
            raise InvalidRequest(f"{frame.op.name} meta must be MessagePack (protocol 3)")
        meta: Any = decode(cls, frame.meta)
        if meta.free_regions and session.windows is not None:
            for region in meta.free_regions:
                session.windows.free(region)
        if not meta.trace:
            return await handler(session, meta, frame.data)
        timings: dict[str, float] = {}
        token = TRACE.set(timings)
        started = time.perf_counter()
        try:
            reply = await handler(session, meta, frame.data)
        finally:
            TRACE.reset(token)
        timings["daemon"] = (time.perf_counter() - started) * 1e6
        reply.meta.trace = timings
        return reply
    return run


async def handle_release(session: Session, meta: ReleaseMeta, data) -> Reply:
    """Leases (from LOOKUP) and load-window regions (``regions``) given back."""
    released = await session.engine.release_many(list(meta.leases), session.owner)
    if meta.regions and session.windows is not None:
        released += sum(session.windows.free(region) for region in meta.regions)
    return Reply(ReleaseReply(released))


async def handle_lookup(session: Session, meta: LookupMeta, data) -> Reply:
    if meta.kv_layout not in ("blocks", "prefix"):
        raise InvalidRequest("field 'kv_layout' must be 'blocks' or 'prefix'")
    request = LookupRequest(
        tenant=session.tenant,
        namespace=Namespace(meta.ns),
        attention_layers=meta.attention_layers,
        ssm_layers=meta.ssm_layers,
        boundaries=meta.boundaries,
        kv_layout=meta.kv_layout,
        shards=tuple(range(meta.tp_size)),
        lease=meta.lease,
        groups=tuple(LayerGroup(Kind.parse(kind), group_id, layers) for kind, group_id, layers in meta.groups),
        group_shards=meta.group_shards,
    )
    result = await session.engine.lookup(request, session.owner)
    return Reply(LookupReply(result.tokens, tuple((wire_ref(ref), lease) for ref, lease in result.objects)))


async def handle_delete(session: Session, frame: Frame) -> Reply:
    ref = ref_from_wire(field(frame.meta, "ref", dict))
    deleted = await session.engine.delete(session.tenant, ref)
    return Reply({"deleted": deleted}, kind=kind_of(ref.key))


async def handle_stats(session: Session, frame: Frame) -> Reply:
    stats = dict(session.engine.stats())
    stats["daemon"] = session.daemon_stats()
    if session.verify_progress is not None:
        stats["verify_progress"] = dict(zip(("done", "total"), session.verify_progress))
    return Reply(stats)


async def handle_inspect(session: Session, frame: Frame) -> Reply:
    text = field(frame.meta, "state_id", str)
    try:
        state_id = bytes.fromhex(text)
    except ValueError:
        raise InvalidRequest("field 'state_id' must be hex") from None
    return Reply(await session.engine.inspect(session.tenant, state_id))


async def handle_verify(session: Session, frame: Frame) -> Reply:
    """The report; meanwhile this connection's STATS replies carry ``verify_progress``."""

    def progress(done: int, total: int) -> None:
        session.verify_progress = (done, total)

    session.verify_progress = (0, 0)
    try:
        return Reply(await session.engine.verify_all(session.tenant, progress))
    finally:
        session.verify_progress = None


async def handle_list(session: Session, frame: Frame) -> Reply:
    """``{"all": bool}``: every tenant's namespaces, for an operator; else the connection's own."""
    everyone = bool(frame.meta.get("all", False))
    if everyone and not session.is_operator:
        raise Forbidden("only an operator (listen.operator_uids) lists every tenant's state")
    return Reply(await session.engine.list_objects(session.tenant, everyone=everyone))


async def handle_purge(session: Session, frame: Frame) -> Reply:
    """``{"ns": hex}`` (one namespace) or ``{"tenant": name}`` (every namespace of a tenant)."""
    namespace, of_tenant = frame.meta.get("ns"), frame.meta.get("tenant")
    if (namespace is None) == (of_tenant is None):
        raise InvalidRequest("PURGE names exactly one of 'ns' and 'tenant'")
    if namespace is not None:
        namespace = Namespace.from_hex(field(frame.meta, "ns", str))
    else:
        of_tenant = field(frame.meta, "tenant", str)
    return Reply(await session.engine.purge(session.tenant, namespace=namespace, of_tenant=of_tenant,
                                            is_operator=session.is_operator))
