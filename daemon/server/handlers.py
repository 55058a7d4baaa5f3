"""Request handlers: one coroutine per opcode, from wire meta to an Engine call and back.

- ``Session`` — what a handler may use: the engine, the connection's tenant, its owner
  token for leases, the shared byte budget, the connection's
  shared-memory windows (``daemon/server/windows.py``; ``None`` without), and the daemon's stats.
- ``Reply`` — a handler's answer: meta, data and, for an inline LOAD, a *borrowed*
  payload view plus ``done`` (release the lease) that the connection runs only after the
  transport has given the view back (``RequestRunner``: the writer's ``wait_flushed``).
- ``handle_*`` — the coroutines of the other opcodes (ping, release, lookup, delete, and the
  admin ops); ``traced`` wraps one with phase timings. Puts are in ``put_handlers.py``,
  loads in ``load_handlers.py``, the ``Op`` → handler table in ``dispatch.py``. Meta is
  decoded with ``protocol/messages.py`` into ``daemon/requests.py`` values; bad meta raises
  ``InvalidRequest`` naming the field.

Handlers never write to the socket; the connection sends the ``Reply`` or the error.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field as dataclass_field

from statetier.daemon.server.budget import ByteBudget
from statetier.daemon.requests import LookupRequest
from statetier.daemon.trace import TRACE
from statetier.daemon.server.windows import Windows
from statetier.protocol.errors import InvalidRequest
from statetier.protocol.frames import Frame, Op
from statetier.protocol.groups import LayerGroup
from statetier.protocol.identity import Namespace
from statetier.protocol.messages import field, ref_from_wire, ref_to_wire


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


def namespace_of(meta: dict) -> Namespace:
    return Namespace.from_hex(field(meta, "ns", str))


def int_list(meta: dict, name: str) -> tuple[int, ...]:
    items = field(meta, name, list, default=[])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise InvalidRequest(f"field {name!r} must be a list of integers")
    return tuple(items)


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


async def handle_release(session: Session, frame: Frame) -> Reply:
    """Leases (from LOOKUP) and load-window regions (``regions``) given back."""
    released = await session.engine.release_many(list(int_list(frame.meta, "leases")), session.owner)
    regions = int_list(frame.meta, "regions")
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
        namespace=namespace_of(meta),
        attention_layers=int_list(meta, "attention_layers"),
        ssm_layers=int_list(meta, "ssm_layers"),
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
