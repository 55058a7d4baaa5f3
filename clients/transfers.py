"""Payloads between torch tensors and the daemon: the put and load exchanges.

- ``Transfers(conn, arena, executor)`` — built by ``AsyncClient.connect``; ``arena`` is the
  mapped host arena (``shm.HostArena``) or ``None`` (TCP, or no host tier).
- ``await put(meta, pairs)`` → ``StateRef``. With an arena: PUT_RESERVE → copy the tensors
  into the reservation → PUT_COMMIT, and PUT_ABORT when anything fails or the caller is
  cancelled (a reservation refused for room, ``CapacityError``, falls back to inline).
  Without: one inline PUT whose data are the tensors' own buffers and the zero
  padding of ``layout_payload``, written back to back (no join).
- ``await load(meta, device)`` → ``(StateRef, {name: tensor})``. Served from the arena:
  copy out, then RELEASE the lease (in ``finally``; written at once, its answer not
  awaited). Inline: tensors from the reply data, sharing the received buffer when it is
  aligned for the dtype.

Copies up to ``INLINE_COPY_BYTES`` of CPU tensors run on the event loop (a thread hop would
cost more); larger ones, and any touching a GPU, run on the client's single copy thread. A
cancelled caller still waits for its copy to end before the arena region is handed back.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any, Callable, Sequence

import torch

from statetier.protocol.errors import CapacityError, ClientClosedError, MalformedFrame, StatetierError, Unavailable
from statetier.protocol.frames import Frame, Op
from statetier.protocol.messages import field, header_from_wire, ref_from_wire, specs_to_wire
from statetier.protocol.sealed import layout_payload
from statetier.protocol.identity import StateRef

from .shm import HostArena
from .values import StoredRef
from .tensors import can_share, spec_of, tensor_from_view, tensor_to_spec_and_view

INLINE_COPY_BYTES = 4 << 20  # a 2 MiB page: ~0.1 ms to copy; the hop cost 0.08+ ms and more when busy
_ZEROS = memoryview(bytes(64))  # alignment padding is below 64 bytes


class Transfers:
    """The put and load exchanges over one connection (and its arena, if any)."""

    def __init__(self, conn, arena: HostArena | None, executor: Executor) -> None:
        self.conn = conn
        self.arena = arena
        self._executor = executor

    # -- put ----------------------------------------------------------------------------

    async def put(self, meta: dict, pairs: Sequence[tuple[str, torch.Tensor]]) -> StateRef:
        specs = [spec_of(name, tensor) for name, tensor in pairs]
        meta = {**meta, "tensors": specs_to_wire(specs)}
        if self.arena is not None:
            reservation = await self._try_reserve(meta)
            if reservation is not None:
                return await self._fill_and_commit(reservation, layout_payload(specs), [t for _, t in pairs])
        return await self._put_inline(meta, pairs)

    async def _put_inline(self, meta: dict, pairs) -> StateRef:
        views = [tensor_to_spec_and_view(name, tensor) for name, tensor in pairs]
        layout = layout_payload([spec for spec, _ in views])
        parts, cursor = [], 0
        for (spec, view), offset in zip(views, layout.offsets):
            if offset > cursor:
                parts.append(_ZEROS[: offset - cursor])
            parts.append(view)
            cursor = offset + spec.nbytes
        frame = await self.conn.request(Op.PUT, meta, parts)
        return _ref_of(frame)

    async def _try_reserve(self, meta: dict) -> Frame | None:
        """PUT_RESERVE's reply, or None when the arena has no room (an inline put goes lower)."""
        try:
            return await self.conn.request(Op.PUT_RESERVE, meta, on_orphan=self._abort_orphan)
        except (CapacityError, Unavailable):
            if not self.conn.is_usable:
                raise
            return None

    async def _fill_and_commit(self, frame: Frame, layout, tensors) -> StateRef:
        ticket = field(frame.meta, "ticket", int)
        try:
            offset = field(frame.meta, "offset", int)
            offsets = _reserved_offsets(frame.meta, layout)
            placements = list(zip(tensors, offsets))
            on_gpu = any(t.device.type != "cpu" for t in tensors)
            await self._copy(lambda: self.arena.write_tensors(offset, placements), layout.payload_len, on_gpu)
            frame = await self.conn.request(Op.PUT_COMMIT, {"ticket": ticket})
        except asyncio.CancelledError:
            self.conn.request_and_forget(Op.PUT_ABORT, {"ticket": ticket})
            raise
        except BaseException:
            await _quietly(self.conn.request(Op.PUT_ABORT, {"ticket": ticket}))
            raise
        return _ref_of(frame)

    def _abort_orphan(self, frame: Frame) -> None:
        ticket = frame.meta.get("ticket")
        if isinstance(ticket, int):
            self.conn.request_and_forget(Op.PUT_ABORT, {"ticket": ticket})

    # -- load ---------------------------------------------------------------------------

    async def load(self, meta: dict, device) -> tuple[StateRef, dict[str, torch.Tensor]]:
        meta = {**meta, "shm": self.arena is not None}
        frame = await self.conn.request(Op.LOAD, meta, on_orphan=self._release_orphan)
        lease = frame.meta.get("lease") if self.arena is not None else None
        try:
            ref, placements, payload_len = header_from_wire(frame.meta)
            offset = frame.meta.get("offset")
            if offset is not None and self.arena is not None:
                if not isinstance(offset, int):
                    raise MalformedFrame("LOAD reply offset must be an integer")
                on_gpu = torch.device(device).type != "cpu"
                tensors = await self._copy(lambda: self.arena.read_tensors(offset, placements, device),
                                           payload_len, on_gpu)
            else:
                tensors = _tensors_from_data(frame.data, placements, payload_len, device)
        finally:
            if isinstance(lease, int):
                # written at once, even for a cancelled caller, ahead of the caller's next
                # request; not awaited: the answer changes nothing and costs a round trip
                self.conn.send_nowait(Op.RELEASE, {"leases": [lease]})
        return ref, {spec.name: tensor for (spec, _), tensor in zip(placements, tensors)}

    def _release_orphan(self, frame: Frame) -> None:
        lease = frame.meta.get("lease")
        if isinstance(lease, int):
            self.conn.request_and_forget(Op.RELEASE, {"leases": [lease]})

    # -- copies -------------------------------------------------------------------------

    async def _copy(self, copy: Callable[[], Any], nbytes: int, on_gpu: bool) -> Any:
        if nbytes <= INLINE_COPY_BYTES and not on_gpu:
            return copy()
        future = asyncio.get_running_loop().run_in_executor(self._executor, copy)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # the copy still touches the arena region: it must end before the region is returned
            while not future.done():
                try:
                    await asyncio.wait([future])
                except asyncio.CancelledError:
                    pass
            raise


def _ref_of(frame: Frame) -> StoredRef:
    ref = ref_from_wire(field(frame.meta, "ref", dict))
    return StoredRef(ref.key, ref.request_id, ref.step, ref.state_id, ref.version, ref.fingerprint,
                     tier=field(frame.meta, "tier", str, default=""),
                     durable=field(frame.meta, "durable", bool, default=False))


def _reserved_offsets(meta: dict, layout) -> list[int]:
    if field(meta, "payload_len", int) != layout.payload_len:
        raise MalformedFrame(f"reservation of {meta['payload_len']} bytes for a {layout.payload_len}-byte payload")
    reserved = field(meta, "tensors", list, default=None)
    if reserved is None:
        return list(layout.offsets)
    offsets = [item[3] if isinstance(item, list) and len(item) == 4 else None for item in reserved]
    if offsets != list(layout.offsets):
        raise MalformedFrame("the reservation lays the tensors out differently from layout_payload")
    return offsets


def _tensors_from_data(data, placements, payload_len: int, device) -> list[torch.Tensor]:
    view = memoryview(data).cast("B")
    if view.nbytes != payload_len:
        raise MalformedFrame(f"LOAD reply carries {view.nbytes} payload bytes; its header says {payload_len}")
    out = []
    for spec, offset in placements:
        if offset < 0 or offset + spec.nbytes > payload_len:
            raise MalformedFrame(f"tensor {spec.name!r} lies outside the payload")
        region = view[offset : offset + spec.nbytes]
        out.append(tensor_from_view(spec, region, device, copy=not can_share(spec, region)))
    return out


async def _quietly(awaitable) -> None:
    """Best-effort cleanup: the daemon may already have dropped the lease or ticket."""
    try:
        await awaitable
    except (StatetierError, ClientClosedError):
        pass  # gone already, or the connection is: the daemon then drops the owner's leases itself
