"""Group commit for the disk tier: index ops made durable in batches.

- ``GroupCommit(flush)`` — ``submit(op, sync=segment, record=..., on_result=...)`` queues
  one index op, naming the segment whose record the op points at and, for a store whose
  bytes were buffered, the ``RecordWrite`` that puts them there. While a batch is in
  flight new ops queue up and go together in the next one, so concurrent stores share one
  fdatasync (``flush`` is ``CommitLog.flush``, ``tiers.disk.log``). ``on_result`` runs
  for every op, in submit order, as soon as its batch is done, whether or not its
  submitter is still waiting (a cancelled ``complete_store`` still publishes): memory
  follows the log. ``drain()`` waits until the queue is empty (the tier's ``close``);
  ``settled()`` waits only for the ops submitted so far (compaction, before it deletes a
  file: every removal from it must be in the checkpoint it forces). ``batches`` / ``ops``
  count what went through, ``waiting`` what is queued now.
- ``RecordWrite(segment, offset, write)`` — a buffered object record: ``write()`` (blocking)
  writes it at ``offset`` in the batch job, before the COMMIT record naming it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from statetier.protocol.errors import InternalError, Unavailable
from .index import IndexOp

if TYPE_CHECKING:  # space imports nothing of this module; the annotation only names it
    from .space import SegmentState


@dataclass(frozen=True, slots=True)
class RecordWrite:
    segment: SegmentState  # its ``unheaded`` forgets ``offset`` once written
    offset: int
    write: Callable[[], None]


@dataclass(slots=True)
class PendingOp:
    op: IndexOp
    sync: SegmentState | None  # the segment to fdatasync first
    record: RecordWrite | None
    on_result: Callable[[object], None] | None
    future: asyncio.Future[object] = field(repr=False)


class GroupCommit:
    def __init__(self, flush: Callable[[list[PendingOp]], Awaitable[list[object]]]) -> None:
        self._flush = flush
        self._queue: list[PendingOp] = []
        self._task: asyncio.Task[None] | None = None
        self._submitted = self._settled = 0
        self._settle_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self.batches = 0
        self.ops = 0

    @property
    def waiting(self) -> int:
        """Ops queued behind the batch in flight."""
        return len(self._queue)

    def submit(self, op: IndexOp, *, sync: SegmentState | None = None, record: RecordWrite | None = None,
               on_result: Callable[[object], None] | None = None) -> asyncio.Future[object]:
        """Queue ``op``; the future resolves to its result (or raises its error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        # a submitter that went away must not leave "exception never retrieved" behind
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._queue.append(PendingOp(op, sync, record, on_result, future))
        self._submitted += 1
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
                self._count_settled(len(batch))
                batch = []
        except asyncio.CancelledError:
            closed = Unavailable("the disk tier closed during a commit")
            leftover, self._queue = batch + self._queue, []
            for pending in leftover:
                self._settle(pending, closed)
            self._count_settled(len(leftover))
            raise
        finally:
            self._task = None

    def _count_settled(self, count: int) -> None:
        self._settled += count
        still = []
        for target, waiter in self._settle_waiters:
            if target > self._settled:
                still.append((target, waiter))
            elif not waiter.done():
                waiter.set_result(None)
        self._settle_waiters = still

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

    async def settled(self) -> None:
        """Return once every op submitted before this call has its result."""
        if self._settled >= self._submitted:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._settle_waiters.append((self._submitted, waiter))
        await waiter

    async def drain(self) -> None:
        while self._task is not None:
            await asyncio.shield(self._task)
