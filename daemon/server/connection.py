"""One client connection: its lifecycle, concurrent requests and flow control.

- ``ConnectionContext`` — what every connection of one listener shares (built by ``Server``).
- ``Connection(ctx)`` — an ``asyncio.BufferedProtocol``. Bytes are received straight into
  the ``FrameDecoder``'s buffers. Peer credentials are checked when the connection is
  made (Unix socket); the first frame must be HELLO (``handshake.admit``); then every
  request frame is run at once, in the callback that received it
  (``request_task.RequestRunner``: one answer per request id; ``eager.start_eagerly``): a
  request that never waits is answered there, with no loop turn, and leaves nothing to
  track; one that waits carries on as its task. PING is answered from the callback directly. A malformed frame, a
  refused HELLO or a silent client gets an ERROR frame with request id 0 and closes this
  connection only.
- Backpressure: at most ``max_inflight`` requests wait; while that many do (or
  received frames wait for a slot) the transport stops reading. Writes go through a
  ``FrameWriter`` (flow control; an inline LOAD's leased payload is sent without a copy
  and its lease released once the transport has let go of it).
- GOODBYE from the client: no more requests are read, the ones received are answered,
  then the connection closes. EOF or a reset is a disconnect: in-flight tasks are
  cancelled. Either way ``engine.release_owner(connection)`` then drops the leases the
  connection still holds.
- ``Server`` uses ``stop_accepting()``, ``request_tasks``, ``close(reason)``, ``abort()``
  and the ``closed`` future (resolved once the owner is released) to shut down.
- The connection's phase (handshake, open, draining, stopping, failed, closing, closed) is a
  ``protocol.phases.ConnectionPhase``: each rule above is a transition of its table, shared
  with the SDK's end; what the connection reads, drops or closes follows from the phase.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from statetier.daemon.server.auth import (PeerCredentials, TenantDirectory, check_peer, is_operator,
                                           peer_credentials)
from statetier.daemon.server.budget import ByteBudget
from statetier.daemon.server.engine_calls import EngineCalls
from statetier.daemon.server.frame_writer import FrameWriter
from statetier.daemon.server.handlers import Session
from statetier.daemon.server.handshake import HANDSHAKE_TIMEOUT_SECONDS, admit, send_with_fds
from statetier.daemon.server.request_task import RequestRunner, count_error
from statetier.daemon.server.eager import start_eagerly
from statetier.daemon.server.windows import Windows
from statetier.protocol.errors import (Forbidden, InternalError, ProtocolError, StatetierError, Unauthorized,
                                       bounded_text)
from statetier.protocol.frames import Frame, FrameDecoder, Op, error_frame, hello_ok_frame
from statetier.protocol.phases import ConnectionPhase, Event

if TYPE_CHECKING:
    from statetier.daemon.metrics import Metrics, NullMetrics

log = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
# After a connection-level error: how long the daemon keeps reading (and dropping) what the
# peer still sends, so that the peer's in-flight write (its HELLO) does not reset the
# connection and lose the error frame before the peer has read it.
FAILED_LINGER_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class ConnectionContext:
    engine: EngineCalls
    tenants: TenantDirectory
    budget: ByteBudget
    listen: object  # config.listen: the peer-credential rules
    max_frame: int
    max_inflight: int
    metrics: Metrics | NullMetrics
    is_unix: bool
    daemon_stats: Callable[[], dict]
    window_bytes: int  # each of a same-host connection's two shared-memory windows; 0: none
    on_open: Callable[["Connection"], None]
    on_close: Callable[["Connection"], None]


class Connection(asyncio.BufferedProtocol):
    """One client connection; see the module docstring."""

    def __init__(self, ctx: ConnectionContext) -> None:
        self._ctx = ctx
        self._decoder = FrameDecoder(ctx.max_frame)
        # made in connection_made, which asyncio calls before any other callback
        self._transport: asyncio.Transport
        self._writer: FrameWriter
        self._peer: PeerCredentials | None = None
        self._session: Session | None = None
        self._answers: RequestRunner | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._running = 0  # a request being run in the callback that received it (``start_eagerly``)
        self._pending: deque[Frame] = deque()
        self._phase = ConnectionPhase()  # handshake → open → draining / stopping / failed → closed
        self._reading = True  # flow control: the transport reads (not a phase)
        self._sink: memoryview | None = None
        self._cleanup: asyncio.Task | None = None
        self._windows: Windows | None = None
        self.closed: asyncio.Future[None] | None = None

    # -- state read by the server ------------------------------------------------------

    @property
    def tenant(self) -> str | None:
        return self._session.tenant if self._session else None

    @property
    def inflight(self) -> int:
        """Requests being answered: those that wait (tasks), and the one running in a callback."""
        return len(self._tasks) + self._running

    @property
    def is_reading_paused(self) -> bool:
        return not self._reading and not self._phase.is_gone

    @property
    def window_regions(self) -> int:
        """Load-window regions the client has not given back yet."""
        return self._windows.regions_in_use if self._windows is not None else 0

    @property
    def request_tasks(self) -> list[asyncio.Task]:
        return list(self._tasks)

    # -- asyncio protocol callbacks ------------------------------------------------------

    # typeshed declares BaseTransport; a stream protocol is always given a Transport
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        loop = asyncio.get_running_loop()
        self._transport = transport
        self.closed = loop.create_future()
        self._ctx.on_open(self)
        self._writer = FrameWriter(transport, self._ctx.max_frame)
        self._writer.start()  # may call pause_writing at once: the writer must be ours first
        _raise_socket_buffers(transport.get_extra_info("socket"))
        if self._ctx.is_unix:
            try:
                self._peer = peer_credentials(transport.get_extra_info("socket"))
                check_peer(self._peer, self._ctx.listen, self._ctx.tenants.uids)
            except OSError as exc:
                self._refuse(Unauthorized(f"cannot read peer credentials: {exc}", auth="peer_credentials"))
                return
            except StatetierError as exc:
                self._refuse(exc)
                return
        self._hello_timer = loop.call_later(HANDSHAKE_TIMEOUT_SECONDS, self._handshake_timed_out)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._phase.drops_input:  # bytes after a connection error (or our close) are read and dropped
            if self._sink is None:
                self._sink = memoryview(bytearray(64 * 1024))
            return self._sink
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._phase.drops_input:
            return
        try:
            frames = self._decoder.buffer_updated(nbytes)
        except ProtocolError as exc:
            self._count_error(exc)
            self._fail(exc)
            return
        for frame in frames:
            self._on_frame(frame)

    def eof_received(self) -> bool:
        # EOF is a disconnect, not a graceful end (that is GOODBYE): the transport closes
        # and connection_lost cancels what is in flight.
        return False

    def pause_writing(self) -> None:
        self._writer.pause()

    def resume_writing(self) -> None:
        self._writer.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self._phase.advance(Event.LOSE)
        self._pending.clear()
        for timer in (self._hello_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._writer.lost()
        for task in self._tasks:
            task.cancel()
        self._cleanup = asyncio.get_running_loop().create_task(self._release_owner())

    async def _release_owner(self) -> None:
        try:
            if self._tasks:
                await asyncio.wait(list(self._tasks))
            if self._session is not None:
                await self._ctx.engine.release_owner(self)
        except Exception:
            log.exception("releasing the leases of a closed connection failed")
        finally:
            if self._windows is not None:
                self._windows.close()
                self._windows = None
            if self.closed is not None:
                self.closed.set_result(None)
            self._ctx.on_close(self)

    # -- handshake -------------------------------------------------------------------

    def _handshake(self, frame: Frame) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        try:
            admitted = admit(frame, self._ctx.tenants, self._peer,
                             tls_verified=bool(self._transport.get_extra_info("peercert")),
                             window_bytes=self._ctx.window_bytes if self._ctx.is_unix else 0)
        except StatetierError as exc:
            self._refuse(exc)
            return
        except Exception:
            log.exception("HELLO failed in the daemon")
            self._fail(InternalError("HELLO failed in the daemon"))
            return
        tenant, windows = admitted.tenant, admitted.windows
        self._windows = windows
        self._session = Session(
            self._ctx.engine, tenant, self, self._ctx.budget, windows, self._ctx.daemon_stats,
            self._ctx.max_frame, is_operator=self._peer is not None and is_operator(self._peer, self._ctx.listen),
        )
        self._answers = RequestRunner(self._session, self._writer, self._ctx.budget, self._ctx.metrics)
        self._phase.advance(Event.ADMIT)
        ok = hello_ok_frame(
            admitted.version, max_frame=self._ctx.max_frame, tenant=tenant,
            max_inflight=self._ctx.max_inflight, shm=windows.hello() if windows is not None else None,
        )
        if windows is None or not send_with_fds(self._transport, ok, windows.fds_for_client(), self._ctx.max_frame):
            if windows is not None:
                windows.close()
                self._windows = self._session.windows = None
                ok.meta["shm"] = None
            self._writer.send_nowait(ok)

    def _handshake_timed_out(self) -> None:
        if self._session is None and not self._phase.is_gone:
            self._fail(ProtocolError(f"no HELLO within {HANDSHAKE_TIMEOUT_SECONDS:g}s"))

    def _refuse(self, exc: StatetierError) -> None:
        if isinstance(exc, (Unauthorized, Forbidden)):
            log.warning("connection refused: %s", bounded_text(exc.message))
            self._ctx.metrics.count_auth_failure(str(exc.detail.get("auth", exc.reason)))
        else:
            self._count_error(exc)
        self._fail(exc)

    def _fail(self, exc: StatetierError) -> None:
        """A connection-level error: report it with request id 0, then close."""
        if self._phase.is_failed or self._phase.is_closing or self._phase.is_gone:
            return
        self._phase.advance(Event.FAIL)
        self._pending.clear()
        if self._transport.is_closing():
            return
        self._writer.send_nowait(error_frame(0, exc))
        if not self._transport.can_write_eof():  # TLS: no half-close
            self._transport.close()
            return
        self._writer.write_eof()  # the peer reads the error, then EOF, and closes
        self._linger = asyncio.get_running_loop().call_later(FAILED_LINGER_SECONDS, self._transport.close)

    # -- requests ---------------------------------------------------------------------

    def _on_frame(self, frame: Frame) -> None:
        if not self._phase.reads_requests:
            return
        if self._session is None:
            self._handshake(frame)
        elif frame.op is Op.GOODBYE:
            self._begin_draining()
        elif frame.op is Op.PING and frame.request_id and not frame.is_error:
            # answered at once, with no task: a ping measures the path, not the scheduler
            self._writer.send_nowait(Frame(Op.PONG, frame.request_id, {}))
            self._ctx.metrics.count_ping()
        else:
            self._pending.append(frame)
            self._start_pending()

    def _start_pending(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending and len(self._tasks) < self._ctx.max_inflight:
            answers = self._answers
            assert answers is not None  # requests are queued only after the handshake
            # run at once: a request that never waits is answered in this callback, with no
            # loop turn; one that waits carries on as its task (``eager.py``)
            self._running += 1
            try:
                task = start_eagerly(loop, answers.run(self._pending.popleft()))
            finally:
                self._running -= 1
            if task is not None:
                self._tasks.add(task)
                task.add_done_callback(self._on_task_done)
        self._update_reading()

    def _update_reading(self) -> None:
        should_read = (
            self._phase.reads_requests and not self._pending and len(self._tasks) < self._ctx.max_inflight
        )
        if should_read == self._reading or self._transport.is_closing():
            return
        self._reading = should_read
        if should_read:
            self._transport.resume_reading()
        else:
            self._transport.pause_reading()

    def _on_task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if self._phase.is_gone:
            return
        self._start_pending()
        if self._phase.is_draining and self._is_idle() and not self._transport.is_closing():
            self._transport.close()

    def _is_idle(self) -> bool:
        return not self._tasks and not self._pending

    def _begin_draining(self) -> None:
        self._phase.advance(Event.GOODBYE)
        self._update_reading()
        if self._is_idle() and not self._transport.is_closing():
            self._transport.close()

    def _count_error(self, exc: StatetierError) -> None:
        count_error(self._ctx.metrics, exc)

    # -- shutdown (called by the server) ---------------------------------------------

    def stop_accepting(self) -> None:
        """Read no further requests; those already running go on."""
        if self._phase.is_gone:
            return
        self._phase.advance(Event.STOP)
        self._pending.clear()
        self._update_reading()

    def close(self, reason: str) -> None:
        """Cancel what still runs, say GOODBYE and close (flushing what was written)."""
        if self._phase.is_gone:
            return
        failed = self._phase.is_failed  # a failed connection already said why (and wrote EOF)
        self._phase.advance(Event.CLOSE)
        for task in self._tasks:
            task.cancel()
        if not self._transport.is_closing():
            if not failed:
                self._writer.send_nowait(Frame(Op.GOODBYE, 0, {"reason": reason}))
            self._transport.close()

    def abort(self) -> None:
        if not self._phase.is_gone:
            self._transport.abort()


def _raise_socket_buffers(sock) -> None:
    if sock is None:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:  # best effort: the kernel caps it at net.core.[rw]mem_max anyway
            pass
