"""One request frame of a connection, run to its one answer.

- ``RequestRunner(session, writer, budget, metrics)`` — built once a connection's HELLO
  is accepted. ``run(frame)`` dispatches the frame to its handler (``dispatch.HANDLERS``)
  and answers with the same request id: the REPLY (held against the byte budget while it
  is written; a borrowed payload's lease released once the transport let go of it), or an
  ERROR frame (a ``StatetierError`` by its code; anything else as ``InternalError`` with
  the traceback logged). A request id already in flight is refused. Time and bytes are
  observed per op (a batch as its items, in one update per kind and op).
- ``count_error(metrics, exc)`` — one error counted by its reason (``NullMetrics``: none counted).

``connection.Connection`` runs each request frame as a task of ``run``; it decides when
(flow control), this module what the answer is.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import nullcontext
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from statetier.daemon.server.budget import ByteBudget
from statetier.daemon.server.frame_writer import ConnectionClosed, FrameWriter
from statetier.daemon.server.dispatch import HANDLERS, JSON_OPS
from statetier.daemon.server.handlers import Reply, Session
from statetier.protocol.errors import InternalError, InvalidRequest, StatetierError
from statetier.protocol.frames import Frame, error_frame

if TYPE_CHECKING:
    from statetier.daemon.metrics import Metrics, NullMetrics

log = logging.getLogger(__name__)


def count_error(metrics: Metrics | NullMetrics, exc: StatetierError) -> None:
    metrics.count_error(exc.reason)


class RequestRunner:
    """Answers the request frames of one admitted connection; see the module docstring."""

    def __init__(self, session: Session, writer: FrameWriter, budget: ByteBudget,
                 metrics: Metrics | NullMetrics) -> None:
        self._session = session
        self._writer = writer
        self._budget = budget
        self._metrics = metrics
        self._request_ids: set[int] = set()

    async def run(self, frame: Frame) -> None:
        started = time.perf_counter()
        request_id = frame.request_id
        try:
            if request_id in self._request_ids:
                raise InvalidRequest(f"request id {request_id} is already in flight")
            self._request_ids.add(request_id)
            try:
                reply = await self._dispatch(frame)
                await self._send_reply(request_id, reply)
            finally:
                self._request_ids.discard(request_id)
        except ConnectionClosed:
            return
        except StatetierError as exc:
            await self._send_error(request_id, exc)
        except Exception:
            log.exception("%s (request %d) failed", frame.op.name, request_id)
            await self._send_error(request_id, InternalError(f"{frame.op.name} failed in the daemon"))
        else:
            nbytes = len(frame.data) + len(reply.data)
            seconds = time.perf_counter() - started
            if reply.items is None:
                self._metrics.observe_op("daemon", reply.kind, frame.op.name.lower(), nbytes, seconds)
            elif reply.items:  # a batch counts as its items, each with its share of the time and bytes
                share = len(reply.items)
                for (kind, op), count in Counter(reply.items).items():  # one update per label set
                    self._metrics.observe_ops("daemon", kind, op, count, nbytes // share * count, seconds / share)

    async def _dispatch(self, frame: Frame) -> Reply:
        if frame.request_id == 0:
            raise InvalidRequest("request id 0 is reserved for connection-level frames")
        handler = HANDLERS.get(frame.op)
        if handler is None:
            raise InvalidRequest(f"{frame.op.name} is not a request")
        if frame.is_binary and frame.op in JSON_OPS:
            raise InvalidRequest(f"{frame.op.name} meta must be JSON, not MessagePack")
        return await handler(self._session, frame)

    async def _send_reply(self, request_id: int, reply: Reply) -> None:
        frame = Frame(reply.op, request_id, reply.meta, reply.data)
        try:
            async with self._budget.hold(reply.hold_bytes) if reply.hold_bytes else nullcontext():
                await self._writer.send(frame)
                if reply.borrowed:
                    await self._writer.wait_flushed()
        finally:
            if reply.done is not None:
                await self._run_done(reply.done)

    async def _run_done(self, done: Callable[[], Awaitable[object]]) -> None:
        # The reply (or its error) is already decided: a failing release is logged, never
        # sent as a second answer to the same request id.
        try:
            await done()
        except Exception:
            log.exception("releasing the lease of an inline reply failed")

    async def _send_error(self, request_id: int, exc: StatetierError) -> None:
        count_error(self._metrics, exc)
        try:
            await self._writer.send(error_frame(request_id, exc))
        except ConnectionClosed:
            pass
