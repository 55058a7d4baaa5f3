"""Group commit for the disk tier: records made durable, then index ops committed, in batches.

- ``GroupCommit(flush)`` — ``submit(op, sync=segment, on_result=...)`` queues one index
  op, naming the segment whose record the op points at. While a batch is in flight new
  ops queue up and go together in the next one, so concurrent stores share one
  fdatasync per segment and one LMDB transaction. ``on_result`` runs for every op, in
  submit order, as soon as its batch is done, whether or not its submitter is still
  waiting (a cancelled ``complete_store`` still publishes): memory follows the index.
  ``drain()`` waits until the queue is empty (the tier's ``close``); ``batches`` / ``ops``
  count what went through, ``waiting`` what is queued now.
- ``make_durable(index, items, fsync)`` — the blocking half, run in the executor:
  fdatasync each named segment (unless ``fsync`` is off), then apply, in one transaction,
  the ops whose segments synced. An op whose segment failed to sync gets that error
  instead: an index entry never commits before the bytes it points at are durable.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from statetier.protocol.errors import InternalError, Unavailable
from statetier.tiers.disk_index import DiskIndex, IndexOp
from statetier.tiers.segments import SegmentFile


@dataclass(slots=True)
class PendingOp:
    op: IndexOp
    sync: object | None  # the segment (tier-side state) to fdatasync first
    on_result: Callable[[object], None] | None
    future: asyncio.Future = field(repr=False)


class GroupCommit:
    def __init__(self, flush: Callable[[list[PendingOp]], Awaitable[list]]) -> None:
        self._flush = flush
        self._queue: list[PendingOp] = []
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.ops = 0

    @property
    def waiting(self) -> int:
        """Ops queued behind the batch in flight."""
        return len(self._queue)

    def submit(self, op: IndexOp, *, sync: object | None = None,
               on_result: Callable[[object], None] | None = None) -> asyncio.Future:
        """Queue ``op``; the future resolves to its result (or raises its error)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        # a submitter that went away must not leave "exception never retrieved" behind
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._queue.append(PendingOp(op, sync, on_result, future))
        if self._task is None:
            self._task = loop.create_task(self._run())
        return future

    async def _run(self) -> None:
        batch: list[PendingOp] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                self.batches += 1
                self.ops += len(batch)
                try:
                    results = await self._flush(batch)
                except Exception as exc:  # the flush already translated it
                    results = [exc] * len(batch)
                for pending, result in zip(batch, results):
                    self._settle(pending, result)
                batch = []
        except asyncio.CancelledError:
            closed = Unavailable("the disk tier closed during a commit")
            leftover, self._queue = batch + self._queue, []
            for pending in leftover:
                self._settle(pending, closed)
            raise
        finally:
            self._task = None

    @staticmethod
    def _settle(pending: PendingOp, result: object) -> None:
        if pending.on_result is not None:
            try:
                pending.on_result(result)
            except Exception as exc:  # a bug in a callback must not stall the other ops
                error = InternalError(f"disk index callback failed: {exc!r}")
                error.__cause__ = exc
                result = error
        if pending.future.done():
            return
        if isinstance(result, BaseException):
            pending.future.set_exception(result)
        else:
            pending.future.set_result(result)

    async def drain(self) -> None:
        while self._task is not None:
            await asyncio.shield(self._task)


def make_durable(index: DiskIndex, items: list[tuple[IndexOp, SegmentFile | None]], fsync: bool) -> list:
    failed: dict[int, OSError] = {}
    if fsync:
        for segment in {id(s): s for _, s in items if s is not None}.values():
            try:
                segment.sync()
            except OSError as exc:
                failed[id(segment)] = exc
    ready = [op for op, segment in items if segment is None or id(segment) not in failed]
    applied = iter(index.apply(ready))
    return [failed[id(segment)] if segment is not None and id(segment) in failed else next(applied)
            for _, segment in items]
