"""Payloads between torch tensors and the daemon: the put and load exchanges.

- ``Transfers(conn, windows, executor)`` — built by ``AsyncClient.connect``; ``windows`` is
  the connection's mapped shared-memory windows (``shm.ClientWindows``) or ``None`` (TCP,
  or a process that could not map them).
- ``await put(meta, pairs)`` → ``StateRef``. With windows: copy the tensors into a region
  of the put window, one ``PUT`` naming it (one round trip); the region is reused once the
  daemon answered (it copies before it digests). Without, or when the window is full: one
  inline ``PUT`` whose data are the tensors' own buffers and the zero padding of
  ``layout_payload``, written back to back (no join).
- ``await load(meta, device, into)`` → ``(StateRef, {name: tensor})``. The reply carries the
  signed header (checked by the daemon) and the payload: in a region of the read-only
  load window, or inline. Each tensor is copied into its destination — ``into``'s tensors,
  or fresh ones — and **verified there** against the header's digests before it is
  returned (``copies.land``): bytes that changed on the way are ``CorruptPayload``, never a
  tensor. A device destination is verified in a private pinned staging buffer, then
  copied to the device. The region goes back with the client's next request
  (``free_regions``), or in a ``RELEASE`` at the loop's next turn when none comes first.

The copies themselves are ``copies.py``. CPU copies below ``protocol.thresholds.
INLINE_WORK_BYTES`` run on the event loop (a thread hop would cost more); larger ones, and
any touching a GPU, run on the client's single copy thread, one job per call. A cancelled
caller still waits for its copy to end before the region is handed back.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import Executor
from typing import Any, Callable, Mapping, Sequence

import torch

from statetier.protocol.errors import CorruptPayload, MalformedFrame, StatetierError
from statetier.protocol.frames import FLAG_ERROR, Frame, Op, raise_for_error
from statetier.protocol.groups import chosen
from statetier.protocol.messages import field, ref_from_wire, specs_to_wire
from statetier.protocol.identity import StateRef
from statetier.protocol.sealed import SealedHeader, layout_payload, parse_header
from statetier.protocol.thresholds import INLINE_WORK_BYTES, run_work

from .copies import destinations, fill, inline_parts, laid_out, land, land_all, target_of
from .shm import ClientWindows
from .tensors import spec_of
from .values import StoredRef

HEADER_CACHE = 1024
_HEADER_LEN = slice(8, 12)  # header_len in the sealed object's prefix (docs/protocol.md §1.1)


class Transfers:
    """The put and load exchanges over one connection (and its windows, if any)."""

    def __init__(self, conn, windows: ClientWindows | None, executor: Executor) -> None:
        self.conn = conn
        self.windows = windows
        self._executor = executor
        self._headers: OrderedDict[bytes, SealedHeader] = OrderedDict()
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
            self.conn.send_nowait(Op.RELEASE, {"regions": regions})

    def _with_free(self, meta: dict) -> dict:
        if self._to_free:
            meta["free_regions"], self._to_free = self._to_free, []
        return meta

    # -- put ----------------------------------------------------------------------------

    async def put(self, meta: dict, pairs: Sequence[tuple[str, torch.Tensor]], trace: dict | None = None
                  ) -> StateRef:
        specs = [spec_of(name, tensor) for name, tensor in pairs]
        layout = layout_payload(specs)
        meta = {**meta, "tensors": specs_to_wire(specs)}
        if trace is not None:
            meta["trace"] = True
        if self.windows is not None and layout.payload_len:
            offset = self.windows.allocate(layout.payload_len)
            if offset is not None:
                return await self._put_from_window(meta, layout, [t for _, t in pairs], offset, trace)
        started = time.perf_counter()
        frame = await self.conn.request(Op.PUT, meta, inline_parts(pairs, layout))
        _record(trace, frame, request=started)
        return _ref_of(frame)

    async def _put_from_window(self, meta: dict, layout, tensors, offset: int, trace: dict | None) -> StateRef:
        region = self.windows.put_window[offset : offset + layout.payload_len]
        on_gpu = any(t.device.type != "cpu" for t in tensors)
        free = _once(lambda: self._free_put([offset]))
        sent = False
        try:
            started = time.perf_counter()
            await self._copy(lambda: fill(region, layout, tensors), layout.payload_len, on_gpu)
            copied = time.perf_counter()
            sent = True  # from here the daemon may read the region until it answers
            frame = await self.conn.request(Op.PUT, self._with_free({**meta, "window": offset}),
                                            on_orphan=lambda _frame: free(), on_unsent=free)
        except BaseException as exc:
            if not sent or not isinstance(exc, asyncio.CancelledError):
                free()  # answered (an error), never sent, or the copy failed
            raise
        free()
        _record(trace, frame, request=copied, client_copy=(started, copied))
        return _ref_of(frame)

    async def put_batch(self, items: Sequence[tuple[dict, Sequence[tuple[str, torch.Tensor]]]]) -> list[StateRef]:
        """Many puts, one ``PUT_BATCH`` frame (one round trip): each payload from a put
        window region, or inline when the window is full. Raises the first item's error."""
        entries, regions, inline, on_gpu, nbytes = [], [], [], False, 0
        free = _once(lambda: self._free_put([o for o, _, _ in regions]))
        sent = False
        try:
            for meta, pairs in items:
                specs = [spec_of(name, tensor) for name, tensor in pairs]
                layout = layout_payload(specs)
                entry = {**meta, "tensors": specs_to_wire(specs)}
                offset = self.windows.allocate(layout.payload_len) if self.windows and layout.payload_len else None
                if offset is None:
                    entry["data_len"] = layout.payload_len
                    inline.extend(inline_parts(pairs, layout))
                else:
                    regions.append((offset, layout, [t for _, t in pairs]))
                    entry["window"] = offset
                    on_gpu = on_gpu or any(t.device.type != "cpu" for _, t in pairs)
                    nbytes += layout.payload_len
                entries.append(entry)
            if regions:
                await self._copy(lambda: [fill(self.windows.put_window[o : o + lay.payload_len], lay, ts)
                                          for o, lay, ts in regions], nbytes, on_gpu)
            sent = True  # from here the daemon may read the regions until it answers
            frame = await self.conn.request(Op.PUT_BATCH, self._with_free({"items": entries}), inline,
                                            on_orphan=lambda _frame: free(), on_unsent=free)
        except BaseException as exc:
            if not sent or not isinstance(exc, asyncio.CancelledError):
                free()  # else on_orphan / on_unsent frees them
            raise
        free()
        answers = _batch_answers(frame, len(entries))
        return [_ref_of(Frame(Op.REPLY, 0, answer)) for answer in answers]

    def _free_put(self, offsets: Sequence[int]) -> None:
        for offset in offsets:
            self.windows.free(offset)

    # -- load ---------------------------------------------------------------------------

    async def load_batch(self, metas: Sequence[dict], namespace_hex: str, device,
                         intos: Sequence[Mapping[str, torch.Tensor] | None]) -> list[dict[str, torch.Tensor]]:
        """Many loads, one ``LOAD_BATCH`` frame: every payload copied into its destination and
        verified there; the window regions go back in one ``RELEASE``. Raises the first
        item's error (after every region was given back)."""
        targets = [target_of(into, device) for into in intos]
        meta = self._with_free({"ns": namespace_hex, "shm": self.windows is not None, "items": list(metas)})
        frame = await self.conn.request(Op.LOAD_BATCH, meta, on_orphan=self._release_batch_orphan)
        answers = frame.meta.get("items")
        regions = [a["region"] for a in answers or [] if isinstance(a, dict) and isinstance(a.get("region"), int)]
        try:
            answers = _batch_answers(frame, len(metas), raise_first=False)
            data = memoryview(frame.data).cast("B")
            jobs, nbytes, on_gpu, failure, retry = [], 0, False, None, []
            for index, (answer, into, target) in enumerate(zip(answers, intos, targets)):
                if "error" in answer or "skipped" in answer:
                    failure = failure or ((index, answer["error"]) if "error" in answer else None)
                    jobs.append(None)
                    continue
                if answer.get("retry") is True:
                    retry.append(index)
                    jobs.append(None)
                    continue
                at, length = answer.get("at"), answer.get("len")
                if not isinstance(at, int) or not isinstance(length, int) or at < 0 or at + length > data.nbytes:
                    raise MalformedFrame("LOAD_BATCH item lies outside the frame's data")
                layers = metas[index].get("layers")
                header, source = self._header_and_payload(Frame(Op.REPLY, 0, answer, data[at : at + length]), layers)
                parts = laid_out(header, layers)
                jobs.append((header, source, parts, destinations(parts, into, target)))
                nbytes += source.nbytes
                on_gpu = on_gpu or target.type != "cpu"
            if failure is not None:
                _raise_item_error(*failure)
            failed = await self._copy(lambda: land_all(jobs, self._staging_for), nbytes, on_gpu)
        finally:
            if regions:
                self._give_back(regions)
        out = [None if job is None else {t.spec.name: d for (t, _), d in zip(job[2], job[3])} for job in jobs]
        for index in sorted(retry + failed):  # no room in the reply, or not intact where it landed
            again = {**metas[index], "ns": namespace_hex, **({"recheck": True} if index in failed else {})}
            try:
                _, out[index] = await self.load(again, device, intos[index])
            except StatetierError as exc:
                exc.detail["item"] = index
                raise
        return out

    def _release_batch_orphan(self, frame: Frame) -> None:
        items = frame.meta.get("items")
        regions = [a["region"] for a in items or [] if isinstance(a, dict) and isinstance(a.get("region"), int)]
        if regions:
            self.conn.send_nowait(Op.RELEASE, {"regions": regions})

    async def load(self, meta: dict, device, into: Mapping[str, torch.Tensor] | None = None,
                   trace: dict | None = None) -> tuple[StateRef, dict[str, torch.Tensor]]:
        """One LOAD, verified where it lands; when that check fails, asked once more with
        ``recheck`` (the daemon then digests every copy it serves, drops a damaged one and
        serves the next): the second answer is verified the same way, or ``CorruptPayload``."""
        try:
            return await self._load_once(meta, device, into, trace)
        except CorruptPayload as exc:
            if meta.get("recheck") or not exc.detail.get("landed"):
                raise
        return await self._load_once({**meta, "recheck": True}, device, into, trace)

    async def _load_once(self, meta: dict, device, into, trace) -> tuple[StateRef, dict[str, torch.Tensor]]:
        target = target_of(into, device)
        meta = self._with_free({**meta, "shm": self.windows is not None})
        if trace is not None:
            meta["trace"] = True
        started = time.perf_counter()
        frame = await self.conn.request(Op.LOAD, meta, on_orphan=self._release_orphan)
        _record(trace, frame, request=started)
        region = frame.meta.get("region")
        try:
            layers = meta.get("layers")
            header, source = self._header_and_payload(frame, layers)
            parts = laid_out(header, layers)
            dests = destinations(parts, into, target)
            on_gpu = target.type != "cpu"
            await self._copy(lambda: land(header, source, parts, dests, self._staging_for, trace),
                             source.nbytes, on_gpu)
        finally:
            if isinstance(region, int):
                # even for a cancelled caller; never awaited: the answer changes nothing
                self._give_back([region])
        return header.ref(), {t.spec.name: d for (t, _), d in zip(parts, dests)}

    def _header_and_payload(self, frame: Frame, layers=None) -> tuple[SealedHeader, memoryview]:
        """The verified header and the payload received (a group object's chosen ``layers``'
        regions only, when the load named them)."""
        data = memoryview(frame.data).cast("B")
        window = frame.meta.get("window")
        if window is None:
            if data.nbytes < _HEADER_LEN.stop:
                raise MalformedFrame("LOAD reply carries no sealed object")
            header_len = int.from_bytes(data[_HEADER_LEN], "little")
            header = self._parse(data[:header_len])
            payload = data[header_len:]
            if payload.nbytes != _received_bytes(header, layers):
                raise MalformedFrame(f"LOAD reply carries {payload.nbytes} payload bytes; its header says "
                                     f"{_received_bytes(header, layers)}")
            return header, payload
        if self.windows is None or not isinstance(window, int) or isinstance(window, bool):
            raise MalformedFrame("LOAD reply names a window region this client cannot read")
        header = self._parse(data)
        nbytes = _received_bytes(header, layers)
        if window < 0 or window + nbytes > self.windows.load_window.nbytes:
            raise MalformedFrame("LOAD reply region lies outside the load window")
        return header, self.windows.load_window[window : window + nbytes]

    def _parse(self, header_bytes: memoryview) -> SealedHeader:
        """The header the daemon verified; parsed once per distinct header (a hot object is
        loaded again and again)."""
        key = bytes(header_bytes)
        header = self._headers.get(key)
        if header is None:
            header = parse_header(key)
            self._headers[key] = header
            if len(self._headers) > HEADER_CACHE:
                self._headers.popitem(last=False)
        return header

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        """A private host buffer (pinned when CUDA is there) of at least ``nbytes``: where a
        device-bound tensor is verified before it is copied to the device. Copy thread only."""
        if self._staging is None or self._staging.numel() < nbytes:
            pin = torch.cuda.is_available()
            self._staging = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        return self._staging

    def _release_orphan(self, frame: Frame) -> None:
        region = frame.meta.get("region")
        if isinstance(region, int):
            self.conn.send_nowait(Op.RELEASE, {"regions": [region]})

    # -- copies -------------------------------------------------------------------------

    async def _copy(self, copy: Callable[[], Any], nbytes: int, on_gpu: bool) -> Any:
        # a cancelled caller still waits for the copy: it touches the window region, which
        # must not be given back before the copy ended
        return await run_work(self._executor, max(nbytes, INLINE_WORK_BYTES) if on_gpu else nbytes, copy)


# ---------------------------------------------------------------- replies and cleanups


def _received_bytes(header: SealedHeader, layers) -> int:
    """The payload bytes a load receives: all, or the chosen layers' regions."""
    return header.payload_len if layers is None else sum(t.region for t in chosen(header.tensors, layers))


def _record(trace: dict | None, frame: Frame, *, request: float, client_copy: tuple | None = None) -> None:
    """Fill ``trace`` (µs): the client's copy, the round trip, and the daemon's own phases."""
    if trace is None:
        return
    trace["round_trip"] = (time.perf_counter() - request) * 1e6
    if client_copy is not None:
        trace["client_copy"] = (client_copy[1] - client_copy[0]) * 1e6
    daemon = frame.meta.get("trace")
    if isinstance(daemon, dict):
        trace.update({f"daemon_{name}": value for name, value in daemon.items() if isinstance(value, (int, float))})


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run at most once, whichever of several cleanup paths gets there first."""
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()
    return call


def _batch_answers(frame: Frame, expected: int, *, raise_first: bool = True) -> list[dict]:
    answers = frame.meta.get("items")
    if not isinstance(answers, list) or len(answers) != expected or not all(isinstance(a, dict) for a in answers):
        raise MalformedFrame(f"a batch reply must answer each of its {expected} items")
    if raise_first:
        for index, answer in enumerate(answers):
            if "error" in answer:
                _raise_item_error(index, answer["error"])
            if "skipped" in answer:
                raise MalformedFrame("a batch reply skipped an item without a failure before it")
    return answers


def _raise_item_error(index: int, error: dict) -> None:
    """Raise a batch item's error, its position in the batch in ``detail["item"]``."""
    try:
        raise_for_error(Frame(Op.ERROR, 0, error, flags=FLAG_ERROR))
    except StatetierError as exc:
        exc.detail["item"] = index
        raise


def _ref_of(frame: Frame) -> StoredRef:
    ref = ref_from_wire(field(frame.meta, "ref", dict))
    return StoredRef(ref.key, ref.request_id, ref.step, ref.state_id, ref.version, ref.fingerprint,
                     tier=field(frame.meta, "tier", str, default=""),
                     published=field(frame.meta, "published", bool, default=False),
                     durable=field(frame.meta, "durable", bool, default=False))
