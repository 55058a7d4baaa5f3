"""The disk tier's checkpoints: the LMDB index brought up to date with the log, in the
background, every so many ops or seconds.

``Checkpointer(index, call, scan_from, mark, every_ops, every_seconds)``:

- ``note(ops, seq)`` — the index ops of group commit ``seq``, durable in the log, in commit
  order. Once ``every_ops`` ops are waiting, or ``every_seconds`` passed since the last
  checkpoint, one checkpoint starts in the background (one at a time).
- ``force()`` — waits until a checkpoint holds every op noted so far (compaction calls it
  before deleting a segment file, whose COMMIT records a restart might otherwise need;
  the tier's ``close`` calls it too). Raises the checkpoint's error.
- ``write_through(ops, seq)`` — ``note`` + ``force`` for a batch the log could not take;
  on failure the ops are taken back, so no later checkpoint holds them.

A checkpoint is one synced LMDB transaction (``DiskIndex.checkpoint``) with its ``Mark``:
the last group commit it holds, and ``scan_from()`` read when it starts — the lowest
segment a later COMMIT record may lie in. ``mark`` is the last one written; ``runs``,
``failures`` and ``waiting`` (ops noted but not yet checkpointed) are for stats.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from statetier.protocol.errors import StatetierError
from .index import DiskIndex, IndexOp, Mark


class Checkpointer:
    def __init__(self, index: DiskIndex, call: Callable[..., Awaitable[Any]], scan_from: Callable[[], int],
                 mark: Mark, every_ops: int, every_seconds: float) -> None:
        self._index = index
        self._call = call
        self._scan_from = scan_from
        self.mark = mark
        self.every_ops = every_ops
        self.every_seconds = every_seconds
        self._pending: list[IndexOp] = []
        self._pending_seq = mark.last_seq
        self._task: asyncio.Task[StatetierError | None] | None = None
        self._last_at = time.monotonic()
        self.runs = self.failures = 0

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def note(self, ops: list[IndexOp], seq: int) -> None:
        self._pending.extend(ops)
        self._pending_seq = seq
        is_due = (len(self._pending) >= self.every_ops
                  or time.monotonic() - self._last_at >= self.every_seconds)
        if is_due and self._task is None:
            self._start()

    async def force(self) -> None:
        target = self._pending_seq
        for _ in range(3):  # the one in flight, then one holding everything noted so far
            if self.mark.last_seq >= target:
                return
            task = self._task if self._task is not None else self._start()
            error = await asyncio.shield(task)
            if error is not None and self.mark.last_seq < target:
                raise error
        raise AssertionError("a forced checkpoint did not catch up")  # pragma: no cover

    async def write_through(self, ops: list[IndexOp], seq: int) -> None:
        before_seq = self._pending_seq
        self.note(ops, seq)
        try:
            await self.force()
        except StatetierError:
            if self.mark.last_seq < seq:  # no checkpoint holds them: take them back
                del self._pending[len(self._pending) - len(ops):]
                self._pending_seq = before_seq
            raise

    def _start(self) -> asyncio.Task[StatetierError | None]:
        self._task = asyncio.get_running_loop().create_task(self._write())
        return self._task

    async def _write(self) -> StatetierError | None:
        try:
            count, mark = len(self._pending), Mark(self._pending_seq, self._scan_from())
            try:
                await self._call(self._index.checkpoint, self._pending[:count], mark)
            except StatetierError as exc:
                self.failures += 1
                return exc
            del self._pending[:count]
            self.mark = mark
            self.runs += 1
            self._last_at = time.monotonic()
            return None
        finally:
            self._task = None
