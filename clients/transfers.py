"""Payloads between torch tensors and the daemon: the put and load exchanges.

- ``Transfers(conn, windows, executor)`` — built by ``AsyncClient.connect``; ``windows`` is
  the connection's mapped shared-memory windows (``shm.ClientWindows``) or ``None`` (TCP,
  or a process that could not map them).
Metas are the typed ``protocol.wire_meta`` Structs (the daemon's replies are read by
``replies.py``).

- ``await put(meta, pairs)`` → ``StateRef`` (``meta``: a ``PutMeta`` without its tensors). With windows: copy the
  tensors into a region of the put window, hashing each region as it is copied, one ``PUT`` naming it and its
  regions' digests (one round trip: the daemon copies the bytes into its own memory and seals over those
  digests, without hashing them again); the region is reused once the daemon answered. Without, or when the
  window is full: one inline ``PUT`` whose data are the tensors' own buffers and the zero padding of
  ``layout_payload``, written back to back (no join).
- ``await put_batch(items)`` — many puts, one ``PUT_BATCH`` frame; in two halves,
  ``fill_put_batch`` (into the put window, nothing sent) and ``send_put_batch``, so that
  ``put_many`` fills frame k+1 while frame k is in flight.
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
a put's copy + digest into the window, and a load's copy + digest, of fewer than
``INLINE_WORK_BYTES`` run on the event loop (a thread hop would cost more, and a plain
copy holds the GIL anyway); larger digests, and any copy touching a GPU, run on the
client's single copy thread, one job per call; a put's copy of GPU tensors there first
waits (on the device) for an event recorded on the caller's stream when the put was made
(``producer_fence``: the producer's writes come first). A cancelled
caller still waits for its copy to end before the region is handed back.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Any, Callable, Mapping, Sequence

import msgspec
import torch

from statetier.protocol.errors import CorruptPayload, MalformedFrame, StatetierError
from statetier.protocol.frames import Frame, Op
from statetier.protocol.groups import chosen
from statetier.protocol.identity import StateRef
from statetier.protocol.sealed import DigestAlg, ParsedHeaders, PayloadLayout, SealedHeader, layout_payload
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

from .copies import LandJob, destinations, fill, fill_and_digest, inline_parts, laid_out, land, land_all, target_of
from .producer_fence import producer_fence
from .replies import batch_answers, decoded, once, raise_item_error, record, stored_ref
from .results import ResultPool
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
        self.results = ResultPool()  # the memory of large results a load allocates, recycled
        self._to_free: list[int] = []  # load-window regions done with, not yet given back
        self._flush_scheduled = False
        self.cuda: Any = torch.cuda  # the seam ``producer_fence`` records and waits through

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
            copy: Callable[[], None] = lambda: _fill(region, layout, tensors, meta)  # noqa: E731
            if on_gpu:  # ordered after the producer's writes (``producer_fence``)
                copy = producer_fence(tensors, self.cuda).fenced(copy)
            await self._copy(copy, layout.payload_len, on_gpu)  # copied and hashed
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
        return await self.send_put_batch(await self.fill_put_batch(items), trace)

    async def fill_put_batch(self, items: Sequence[tuple[PutMeta, Sequence[tuple[str, torch.Tensor]]]]
                             ) -> "FilledPuts":
        """The first half of ``put_batch``: each payload copied into a put-window region (or
        kept for the frame, inline), nothing sent; ``send_put_batch`` sends it, or
        ``FilledPuts.free`` gives its regions back. A ``put_many`` fills the next frame while
        this one is in flight: a batch larger than the window streams through it."""
        filled = FilledPuts(items, self._free_put)
        try:
            for meta, pairs in items:
                layout, meta.tensors = self._layout_of(pairs)
                offset = self.windows.allocate(layout.payload_len) if self.windows and layout.payload_len else None
                if offset is None:
                    meta.data_len, meta.window, meta.digests = layout.payload_len, None, None
                    filled.inline.extend(inline_parts(pairs, layout))
                else:
                    filled.regions.append((offset, layout, [t for _, t in pairs], meta))
                    meta.window, meta.data_len = offset, None
                    filled.on_gpu = filled.on_gpu or any(t.device.type != "cpu" for _, t in pairs)
            filled.started = time.perf_counter()
            if filled.regions:
                windows = self.windows
                assert windows is not None  # the regions lie in its put window

                def fill_regions() -> None:
                    for o, lay, ts, m in filled.regions:
                        _fill(windows.put_window[o : o + lay.payload_len], lay, ts, m)

                copy = fill_regions
                if filled.on_gpu:  # ordered after the producer's writes (``producer_fence``)
                    copy = producer_fence([t for _, _, ts, _ in filled.regions for t in ts], self.cuda).fenced(copy)
                await self._copy(copy, sum(lay.payload_len for _, lay, _, _ in filled.regions), filled.on_gpu)
            filled.copied = time.perf_counter()
        except BaseException:
            filled.free()
            raise
        return filled

    async def send_put_batch(self, filled: "FilledPuts", trace: dict | None = None) -> list[StateRef]:
        """The second half of ``put_batch``: one ``PUT_BATCH`` of what ``filled`` holds; its
        regions go back once answered (or with the orphaned answer of a cancelled caller)."""
        sent = False
        try:
            batch = self._with_free(PutBatchMeta(tuple(meta for meta, _ in filled.items), trace=trace is not None))
            if trace is not None:
                trace["window_steps"] = trace.get("window_steps", 0) + 1
            sent = True  # from here the daemon may read the regions until it answers
            frame = await self.conn.request(Op.PUT_BATCH, batch, filled.inline, on_orphan=lambda _frame: filled.free(),
                                            on_unsent=filled.free)
        except BaseException as exc:
            if not sent or not isinstance(exc, asyncio.CancelledError):
                filled.free()  # else on_orphan / on_unsent frees them
            raise
        filled.free()
        reply = decoded(PutBatchReply, frame)
        record(trace, reply, request=filled.copied, client_copy=(filled.started, filled.copied))
        return [stored_ref(answer) for answer in batch_answers(reply.items, len(filled.items))]

    def fits_beside_another(self, items: Sequence[tuple[PutMeta, Sequence[tuple[str, torch.Tensor]]]]) -> bool:
        """Whether the payloads of ``items`` fit half the put window (so they can be filled
        while another batch of that size is in flight); True without windows."""
        if self.windows is None:
            return True
        nbytes = sum(self._layout_of(pairs)[0].payload_len for _, pairs in items)
        return nbytes <= self.windows.put_window.nbytes // 2

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
        verified there. A batch larger than what is free of the load window is answered half
        a window at a time (the rest ``retry``): the next step is asked as soon as a reply
        arrives, so the daemon fills the other half while this process copies and verifies
        this step (``trace["window_steps"]`` counts the frames). Raises the first item's
        error (after every region was given back), its position among ``metas`` in
        ``detail["item"]``."""
        out: list = [None] * len(metas)
        asked: asyncio.Future | None = self._ask_step(list(range(len(metas))), metas, namespace, trace)
        held = False  # whether regions of ours were held when the step now answered was asked
        try:
            while asked is not None:
                todo, frame, started = await asked
                asked = None
                retry, answered = _retried(frame, todo)
                if retry and answered:
                    asked = self._ask_step(retry, metas, namespace, trace)  # pipelined: sent before landing
                    await asyncio.sleep(0)  # let it be written before the copy holds the loop
                failed = await self._land_step(todo, frame, started, metas, device, intos, out, trace)
                alone = [retry.pop(0)] if retry and not answered and not held else []  # others hold the window
                await self._load_alone(sorted(failed + alone), metas, namespace, device, intos, out)
                if asked is None and retry:
                    asked = self._ask_step(retry, metas, namespace, trace)
                held = asked is not None and answered
        finally:
            if asked is not None:
                await _settled(asked, self._release_batch_orphan)
        return out

    def _ask_step(self, todo: list[int], metas, namespace: bytes, trace: dict | None) -> asyncio.Future:
        """One ``LOAD_BATCH`` of the items ``todo``, sent now: its (todo, reply frame, start)."""
        batch = self._with_free(LoadBatchMeta(namespace, tuple(metas[i] for i in todo), shm=self.windows is not None,
                                              trace=trace is not None))
        if trace is not None:
            trace["window_steps"] = trace.get("window_steps", 0) + 1
        started = time.perf_counter()

        async def answered() -> tuple[list[int], Frame, float]:  # the request made in the task, so that
            # a step cancelled before it ran leaves no coroutine never awaited
            return todo, await self.conn.request(Op.LOAD_BATCH, batch, on_orphan=self._release_batch_orphan), started

        return asyncio.ensure_future(answered())

    async def _load_alone(self, indices: list[int], metas, namespace: bytes, device, intos, out: list) -> None:
        """Each of ``indices`` in a LOAD of its own (not intact where it landed: asked with
        recheck; or nothing fit the window, which other frames hold)."""
        for index in indices:
            again = msgspec.structs.replace(metas[index], ns=namespace, free_regions=(), trace=False,
                                            recheck=metas[index].recheck or out[index] is _FAILED)
            try:
                _, out[index] = await self.load(again, device, intos[index])
            except StatetierError as exc:
                exc.detail["item"] = index
                raise

    async def _land_step(self, todo: list[int], frame: Frame, started: float, metas, device, intos, out: list,
                         trace: dict | None) -> list[int]:
        """The items ``todo`` of one ``LOAD_BATCH`` reply landed: each landed item's tensors
        into ``out``; the items not intact where they landed (marked ``_FAILED`` in ``out``)."""
        targets = [target_of(intos[i], device) for i in todo]
        reply = decoded(LoadBatchReply, frame)
        record(trace, reply, request=started)
        answers = reply.items
        regions = [a.region for a in answers if a.region is not None]
        try:
            batch_answers(answers, len(todo), raise_first=False)
            data = memoryview(frame.data).cast("B")
            jobs: list[LandJob | None] = []
            nbytes, on_gpu, failure = 0, False, None
            for index, answer, target in zip(todo, answers, targets):
                if answer.error is not None or answer.skipped or answer.retry:
                    failure = failure or ((index, answer.error) if answer.error is not None else None)
                    jobs.append(None)
                    continue
                if answer.at + answer.len > data.nbytes:
                    raise MalformedFrame("LOAD_BATCH item lies outside the frame's data")
                layers = metas[index].layers
                header, source = self._header_and_payload(answer, data[answer.at : answer.at + answer.len], layers)
                parts = laid_out(header, layers)
                jobs.append((header, source, parts, destinations(parts, intos[index], target, self.results.empty)))
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
            if job is not None:
                out[index] = _FAILED if index in failed else {t.spec.name: d for (t, _), d in zip(job[2], job[3])}
        return failed

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
        while True:
            try:
                return await self._load_once(meta, device, into, trace)
            except CorruptPayload as exc:
                if meta.recheck or not exc.detail.get("landed"):
                    raise
            # asked again with a fresh meta: the one sent was filled in (its free regions, its trace)
            meta = msgspec.structs.replace(meta, recheck=True, free_regions=(), trace=False)

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
            dests = destinations(parts, into, target, self.results.empty)
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


class FilledPuts:
    """A ``PUT_BATCH`` filled and not yet answered: its items, their put-window regions
    ``(offset, layout, tensors)``, the inline parts, and ``free()`` (once) for the regions."""

    def __init__(self, items, free_put: Callable[[Sequence[int]], None]) -> None:
        self.items = items
        self.regions: list[tuple[int, PayloadLayout, list[torch.Tensor], PutMeta]] = []
        self.inline: list[memoryview] = []
        self.on_gpu = False
        self.started = self.copied = time.perf_counter()
        self.free = once(lambda: free_put([o for o, _, _, _ in self.regions]))


_FAILED = object()  # an item of a load batch not intact where it landed (asked again with recheck)


_DIGEST_ALGS = {alg.label: alg for alg in DigestAlg}


def _fill(region: memoryview, layout: PayloadLayout, tensors: Sequence[torch.Tensor], meta: PutMeta) -> None:
    """The payload into its put-window region, each region hashed as it is copied: the
    digests go with the put (``meta.digests``), and the daemon seals over them. A digest
    the daemon does not know is left to it to refuse (a plain copy, no digests)."""
    alg = _DIGEST_ALGS.get(meta.digest)
    if alg is None:
        fill(region, layout, tensors)
    else:
        meta.digests = fill_and_digest(region, layout, tensors, alg)


def _retried(frame: Frame, todo: list[int]) -> tuple[list[int], bool]:
    """The items of a ``LOAD_BATCH`` reply answered ``retry``, and whether any was answered
    otherwise (``MalformedFrame`` is left to the landing, which decodes it again)."""
    try:
        answers = decoded(LoadBatchReply, frame).items
    except StatetierError:
        return [], True
    retry = [index for index, answer in zip(todo, answers) if answer.retry]
    return retry, len(retry) < len(todo)


async def _settled(asked: asyncio.Future, release: Callable[[Frame], None]) -> None:
    """A step asked and no longer wanted (an error or a cancellation on the way): its
    reply's regions go back once it comes; nothing it raises matters any more."""
    if not asked.done():
        asked.cancel()
    try:
        _, frame, _ = await asked
    except (asyncio.CancelledError, Exception):
        return
    release(frame)


def _received_bytes(header: SealedHeader, layers) -> int:
    """The payload bytes a load receives: all, or the chosen layers' regions."""
    return header.payload_len if layers is None else sum(t.region for t in chosen(header.tensors, layers))

