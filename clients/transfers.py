"""Payloads between torch tensors and the daemon: the put and load exchanges.

- ``Transfers(conn, windows, executor)`` — built by ``AsyncClient.connect``; ``windows`` is
  the connection's mapped shared-memory windows (``shm.ClientWindows``) or ``None`` (TCP,
  or a process that could not map them).
Metas are the typed ``protocol.wire_meta`` Structs (the daemon's replies are read by
``replies.py``).

- ``await put(meta, pairs)`` → ``StateRef`` (``meta``: a ``PutMeta`` without its tensors). With windows: copy the
  tensors into a region of the put window, one ``PUT`` naming it (one round trip); the region is reused once the
  daemon answered (it copies before it digests). Without, or when the window is full: one
  inline ``PUT`` whose data are the tensors' own buffers and the zero padding of
  ``layout_payload``, written back to back (no join).
- ``await put_batch(items)`` — many puts, one ``PUT_BATCH`` frame.
- ``await load(meta, device, into)`` → ``(StateRef, {name: tensor})`` (``meta``: a ``LoadMeta``);
  ``await load_batch(metas, namespace, device, intos)`` — many, one ``LOAD_BATCH`` frame. The reply carries the
  signed header (checked by the daemon) and the payload: in a region of the read-only
  load window, or inline. Each tensor is copied into its destination — ``into``'s tensors,
  or fresh ones — and **verified there** against the header's digests before it is
  returned (``copies.land``): bytes that changed on the way are ``CorruptPayload``, never a
  tensor. A device destination is verified in a private pinned staging buffer, then
  copied to the device. The region goes back with the client's next request
  (``free_regions``), or in a ``RELEASE`` at the loop's next turn when none comes first.

The copies themselves are ``copies.py``. Where they run is ``protocol.thresholds``' rule:
a put's plain copies into the window, and a load's copy + digest of fewer than
``INLINE_WORK_BYTES``, run on the event loop (a thread hop would cost more, and a plain
copy holds the GIL anyway); larger digests, and any copy touching a GPU, run on the
client's single copy thread, one job per call. A cancelled
caller still waits for its copy to end before the region is handed back.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Any, Callable, Mapping, Sequence

import torch

from statetier.protocol.errors import CorruptPayload, MalformedFrame, StatetierError
from statetier.protocol.frames import Frame, Op
from statetier.protocol.groups import chosen
from statetier.protocol.identity import StateRef
from statetier.protocol.sealed import ParsedHeaders, PayloadLayout, SealedHeader, layout_payload
from statetier.protocol.thresholds import INLINE_WORK_BYTES, run_work
from statetier.protocol.wire_meta import (
    LoadAnswer,
    LoadBatchMeta,
    LoadBatchReply,
    LoadMeta,
    PutAnswer,
    PutBatchMeta,
    PutBatchReply,
    PutMeta,
    ReleaseMeta,
    decode_reply,
    wire_specs,
)

from .copies import LandJob, destinations, fill, inline_parts, laid_out, land, land_all, target_of
from .replies import batch_answers, decoded, once, raise_item_error, record, stored_ref
from .shm import ClientWindows
from .tensors import spec_of

HEADER_CACHE = 1024
LAYOUTS_KEPT = 256
_HEADER_LEN = slice(8, 12)  # header_len in the sealed object's prefix (docs/protocol.md §1.1)


class Transfers:
    """The put and load exchanges over one connection (and its windows, if any)."""

    def __init__(self, conn, windows: ClientWindows | None, executor: Executor) -> None:
        self.conn = conn
        self.windows = windows
        self._executor = executor
        self._headers = ParsedHeaders(HEADER_CACHE)  # a hot object is loaded again and again
        self._layouts: dict[tuple, tuple] = {}  # (name, dtype, shape)... -> (payload layout, wire specs)
        self._staging: torch.Tensor | None = None
        self._to_free: list[int] = []  # load-window regions done with, not yet given back
        self._flush_scheduled = False

    def _give_back(self, regions: Sequence[int]) -> None:
        """Regions go back with the next request this client sends (``free_regions``), or
        in a ``RELEASE`` of their own at the loop's next turn when none comes first."""
        self._to_free.extend(regions)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_free)

    def _flush_free(self) -> None:
        self._flush_scheduled = False
        if self._to_free:
            regions, self._to_free = self._to_free, []
            self.conn.send_nowait(Op.RELEASE, ReleaseMeta(regions=tuple(regions)))

    def _with_free(self, meta):
        if self._to_free:
            meta.free_regions, self._to_free = tuple(self._to_free), []
        return meta

    # -- put ----------------------------------------------------------------------------

    async def put(self, meta: PutMeta, pairs: Sequence[tuple[str, torch.Tensor]], trace: dict | None = None
                  ) -> StateRef:
        layout, meta.tensors = self._layout_of(pairs)
        meta.trace = trace is not None
        if self.windows is not None and layout.payload_len:
            offset = self.windows.allocate(layout.payload_len)
            if offset is not None:
                return await self._put_from_window(meta, layout, [t for _, t in pairs], offset, trace)
        started = time.perf_counter()
        answer = decoded(PutAnswer, await self.conn.request(Op.PUT, meta, inline_parts(pairs, layout)))
        record(trace, answer, request=started)
        return stored_ref(answer)

    async def _put_from_window(self, meta: PutMeta, layout, tensors, offset: int, trace: dict | None) -> StateRef:
        assert self.windows is not None  # the caller allocated ``offset`` there
        region = self.windows.put_window[offset : offset + layout.payload_len]
        on_gpu = any(t.device.type != "cpu" for t in tensors)
        free = once(lambda: self._free_put([offset]))
        sent = False
        try:
            started = time.perf_counter()
            await self._copy(lambda: fill(region, layout, tensors), 0, on_gpu)  # a plain copy: no digest
            copied = time.perf_counter()
            sent = True  # from here the daemon may read the region until it answers
            meta.window = offset
            frame = await self.conn.request(Op.PUT, self._with_free(meta), on_orphan=lambda _frame: free(),
                                            on_unsent=free)
        except BaseException as exc:
            if not sent or not isinstance(exc, asyncio.CancelledError):
                free()  # answered (an error), never sent, or the copy failed
            raise
        free()
        answer = decoded(PutAnswer, frame)
        record(trace, answer, request=copied, client_copy=(started, copied))
        return stored_ref(answer)

    async def put_batch(self, items: Sequence[tuple[PutMeta, Sequence[tuple[str, torch.Tensor]]]],
                        trace: dict | None = None) -> list[StateRef]:
        """Many puts, one ``PUT_BATCH`` frame (one round trip): each payload from a put
        window region, or inline when the window is full. Raises the first item's error."""
        regions: list[tuple[int, PayloadLayout, list[torch.Tensor]]] = []
        inline: list[memoryview] = []
        on_gpu = False
        free = once(lambda: self._free_put([o for o, _, _ in regions]))
        sent = False
        try:
            for meta, pairs in items:
                layout, meta.tensors = self._layout_of(pairs)
                offset = self.windows.allocate(layout.payload_len) if self.windows and layout.payload_len else None
                if offset is None:
                    meta.data_len = layout.payload_len
                    inline.extend(inline_parts(pairs, layout))
                else:
                    regions.append((offset, layout, [t for _, t in pairs]))
                    meta.window = offset
                    on_gpu = on_gpu or any(t.device.type != "cpu" for _, t in pairs)
            started = time.perf_counter()
            if regions:
                windows = self.windows
                assert windows is not None  # the regions lie in its put window

                def fill_regions() -> None:
                    for o, lay, ts in regions:
                        fill(windows.put_window[o : o + lay.payload_len], lay, ts)

                await self._copy(fill_regions, 0, on_gpu)  # plain copies: no digest
            copied = time.perf_counter()
            sent = True  # from here the daemon may read the regions until it answers
            batch = self._with_free(PutBatchMeta(tuple(meta for meta, _ in items), trace=trace is not None))
            frame = await self.conn.request(Op.PUT_BATCH, batch, inline, on_orphan=lambda _frame: free(),
                                            on_unsent=free)
        except BaseException as exc:
            if not sent or not isinstance(exc, asyncio.CancelledError):
                free()  # else on_orphan / on_unsent frees them
            raise
        free()
        reply = decoded(PutBatchReply, frame)
        record(trace, reply, request=copied, client_copy=(started, copied))
        return [stored_ref(answer) for answer in batch_answers(reply.items, len(items))]

    def _layout_of(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> tuple:
        """The payload layout and wire specs of a put's tensors, built once per distinct
        (name, dtype, shape) list: a batch's items, and an engine's pages, repeat one."""
        key: tuple | None
        try:
            key = tuple((name, tensor.dtype, tensor.shape) for name, tensor in pairs)
            found = self._layouts.get(key)
        except (AttributeError, TypeError):  # not a tensor, or a name that is no str: spec_of says why
            key, found = None, None
        if found is None:
            specs = [spec_of(name, tensor) for name, tensor in pairs]
            found = (layout_payload(specs), wire_specs(specs))
            if key is not None:
                if len(self._layouts) >= LAYOUTS_KEPT:
                    self._layouts.clear()
                self._layouts[key] = found
        return found

    def _free_put(self, offsets: Sequence[int]) -> None:
        for offset in offsets:
            assert self.windows is not None  # the offsets lie in its put window
            self.windows.free(offset)

    # -- load ---------------------------------------------------------------------------

    async def load_batch(self, metas: Sequence[LoadMeta], namespace: bytes, device,
                         intos: Sequence[Mapping[str, torch.Tensor] | None], trace: dict | None = None
                         ) -> list[dict[str, torch.Tensor]]:
        """Many loads in ``LOAD_BATCH`` frames: every payload copied into its destination and
        verified there. What the load window had no room for is asked again, in the next
        frame, once this one's regions went back with it: a batch larger than the window
        streams through it in window-sized steps. Raises the first item's error (after every
        region was given back), its position among ``metas`` in ``detail["item"]``."""
        out: list = [None] * len(metas)
        todo = list(range(len(metas)))
        while todo:
            retry, failed = await self._load_step(todo, metas, namespace, device, intos, out, trace)
            alone = [retry.pop(0)] if retry and len(retry) == len(todo) else []  # nothing fit: others hold the window
            for index in sorted(failed + alone):  # not intact where it landed (asked with recheck), or alone
                again = _copy_meta(metas[index], ns=namespace, recheck=metas[index].recheck or index in failed)
                try:
                    _, out[index] = await self.load(again, device, intos[index])
                except StatetierError as exc:
                    exc.detail["item"] = index
                    raise
            todo = retry
        return out

    async def _load_step(self, todo: list[int], metas, namespace: bytes, device, intos, out: list,
                         trace: dict | None) -> tuple[list[int], list[int]]:
        """One ``LOAD_BATCH`` of the items ``todo``: each landed item's tensors into ``out``;
        (the items to ask again, the items not intact where they landed)."""
        targets = [target_of(intos[i], device) for i in todo]
        batch = self._with_free(LoadBatchMeta(namespace, tuple(metas[i] for i in todo), shm=self.windows is not None,
                                              trace=trace is not None))
        started = time.perf_counter()
        frame = await self.conn.request(Op.LOAD_BATCH, batch, on_orphan=self._release_batch_orphan)
        reply = decoded(LoadBatchReply, frame)
        record(trace, reply, request=started)
        answers = reply.items
        regions = [a.region for a in answers if a.region is not None]
        try:
            batch_answers(answers, len(todo), raise_first=False)
            data = memoryview(frame.data).cast("B")
            jobs: list[LandJob | None] = []
            nbytes, on_gpu, failure, retry = 0, False, None, []
            for index, answer, target in zip(todo, answers, targets):
                if answer.error is not None or answer.skipped:
                    failure = failure or ((index, answer.error) if answer.error is not None else None)
                    jobs.append(None)
                    continue
                if answer.retry:
                    retry.append(index)
                    jobs.append(None)
                    continue
                if answer.at + answer.len > data.nbytes:
                    raise MalformedFrame("LOAD_BATCH item lies outside the frame's data")
                layers = metas[index].layers
                header, source = self._header_and_payload(answer, data[answer.at : answer.at + answer.len], layers)
                parts = laid_out(header, layers)
                jobs.append((header, source, parts, destinations(parts, intos[index], target)))
                nbytes += source.nbytes
                on_gpu = on_gpu or target.type != "cpu"
            if failure is not None:
                raise_item_error(*failure)
            landed = await self._copy(lambda: land_all(jobs, self._staging_for, trace), nbytes, on_gpu)
            failed = [todo[n] for n in landed]
        finally:
            if regions:
                self._give_back(regions)
        for index, job in zip(todo, jobs):
            if job is not None and index not in failed:
                out[index] = {t.spec.name: d for (t, _), d in zip(job[2], job[3])}
        return retry, failed

    def _release_batch_orphan(self, frame: Frame) -> None:
        try:
            regions = tuple(a.region for a in decoded(LoadBatchReply, frame).items if a.region is not None)
        except StatetierError:
            return  # an error answer: no region was taken
        if regions:
            self.conn.send_nowait(Op.RELEASE, ReleaseMeta(regions=regions))

    async def load(self, meta: LoadMeta, device, into: Mapping[str, torch.Tensor] | None = None,
                   trace: dict | None = None) -> tuple[StateRef, dict[str, torch.Tensor]]:
        """One LOAD, verified where it lands; when that check fails, asked once more with
        ``recheck`` (the daemon then digests every copy it serves, drops a damaged one and
        serves the next): the second answer is verified the same way, or ``CorruptPayload``."""
        try:
            return await self._load_once(meta, device, into, trace)
        except CorruptPayload as exc:
            if meta.recheck or not exc.detail.get("landed"):
                raise
        return await self._load_once(_copy_meta(meta, recheck=True), device, into, trace)

    async def _load_once(self, meta: LoadMeta, device, into, trace) -> tuple[StateRef, dict[str, torch.Tensor]]:
        target = target_of(into, device)
        meta.shm = self.windows is not None
        meta.trace = trace is not None
        started = time.perf_counter()
        frame = await self.conn.request(Op.LOAD, self._with_free(meta), on_orphan=self._release_orphan)
        answer = decoded(LoadAnswer, frame)
        record(trace, answer, request=started)
        try:
            header, source = self._header_and_payload(answer, memoryview(frame.data).cast("B"), meta.layers)
            parts = laid_out(header, meta.layers)
            dests = destinations(parts, into, target)
            on_gpu = target.type != "cpu"
            await self._copy(lambda: land(header, source, parts, dests, self._staging_for, trace),
                             source.nbytes, on_gpu)
        finally:
            if answer.region is not None:
                # even for a cancelled caller; never awaited: the answer changes nothing
                self._give_back([answer.region])
        return header.ref(), {t.spec.name: d for (t, _), d in zip(parts, dests)}

    def _header_and_payload(self, answer: LoadAnswer, data: memoryview, layers=None) -> tuple[SealedHeader, memoryview]:
        """The verified header and the payload received (a group object's chosen ``layers``'
        regions only, when the load named them): after the header in ``data``, or in the
        load window at ``answer.window``."""
        if answer.window is None:
            if data.nbytes < _HEADER_LEN.stop:
                raise MalformedFrame("LOAD reply carries no sealed object")
            header_len = int.from_bytes(data[_HEADER_LEN], "little")
            header = self._headers.parse(data[:header_len])
            payload = data[header_len:]
            if payload.nbytes != _received_bytes(header, layers):
                raise MalformedFrame(f"LOAD reply carries {payload.nbytes} payload bytes; its header says "
                                     f"{_received_bytes(header, layers)}")
            return header, payload
        if self.windows is None:
            raise MalformedFrame("LOAD reply names a window region this client cannot read")
        header = self._headers.parse(data)
        nbytes = _received_bytes(header, layers)
        if answer.window + nbytes > self.windows.load_window.nbytes:
            raise MalformedFrame("LOAD reply region lies outside the load window")
        return header, self.windows.load_window[answer.window : answer.window + nbytes]

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        """A private host buffer (pinned when CUDA is there) of at least ``nbytes``: where a
        device-bound tensor is verified before it is copied to the device. Copy thread only."""
        if self._staging is None or self._staging.numel() < nbytes:
            pin = torch.cuda.is_available()
            self._staging = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        return self._staging

    def _release_orphan(self, frame: Frame) -> None:
        if not frame.is_binary:
            return  # an error answer: no region was taken
        region = decode_reply(LoadAnswer, frame.meta).region
        if region is not None:
            self.conn.send_nowait(Op.RELEASE, ReleaseMeta(regions=(region,)))

    # -- copies -------------------------------------------------------------------------

    async def _copy(self, copy: Callable[[], Any], hashed: int, on_gpu: bool) -> Any:
        """``copy()`` (which digests ``hashed`` bytes) where ``protocol.thresholds`` says; one
        touching a GPU always on the copy thread (it waits for the device)."""
        # a cancelled caller still waits for the copy: it touches the window region, which
        # must not be given back before the copy ended
        return await run_work(self._executor, max(hashed, INLINE_WORK_BYTES) if on_gpu else hashed, copy)


def _received_bytes(header: SealedHeader, layers) -> int:
    """The payload bytes a load receives: all, or the chosen layers' regions."""
    return header.payload_len if layers is None else sum(t.region for t in chosen(header.tensors, layers))


def _copy_meta(meta: LoadMeta, **changes) -> LoadMeta:
    """A fresh ``LoadMeta`` like ``meta`` (a meta is filled in once it is sent)."""
    fields = {name: getattr(meta, name) for name in meta.__struct_fields__}
    fields.update(changes, free_regions=(), trace=False)
    return LoadMeta(**fields)
