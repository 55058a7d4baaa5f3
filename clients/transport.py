"""One asyncio connection to the daemon: frames in, frames out, many requests in flight.

- ``await connect(url, *, tenant, token, ssl, shm, timeout)`` → ``Connection`` after the
  HELLO / HELLO_OK handshake (``handshake.py``). On a Unix socket with ``shm`` HELLO_OK
  carries the connection's two shared-memory windows as file descriptors; ``conn.shm`` is
  then a ``WindowFds`` (the caller maps and closes them), else ``None``. ``url``: see
  ``endpoint.parse_url`` (TLS over ``tcp://`` when ``ssl`` is given, always over ``tcps://``).
- ``await conn.request(op, meta, data=b"")`` → the REPLY ``Frame``; an ERROR answer is
  raised as its typed error (``protocol.errors``). ``data`` may be a list of buffers,
  sent back to back with ``writelines`` (no join). Requests get per-connection ids and
  are answered in any order; at most HELLO_OK's ``max_inflight`` are outstanding, more wait.
- ``on_orphan``: what to do with the answer to a request its caller cancelled (give a
  window region back) — called with the frame (a REPLY or an ERROR), may return an
  awaitable; ``on_unsent``: called when the request was never written.
  ``request_and_forget(op, meta)`` sends such a cleanup in the background;
  ``send_nowait(op, meta)`` writes one at once and drops its answer.
- ``await conn.close()`` → GOODBYE, then the socket closes. Later calls raise
  ``ClientClosedError``; after a lost connection (or a connection-level ERROR) pending
  and later calls raise ``Unavailable`` (or that error).

Receiving is a ``BufferedProtocol`` over ``FrameDecoder``: a large payload is received
straight into the buffer its frame keeps. Writes honour ``pause_writing``. No pickle.
Kept whole: sending, receiving and failing share one state (pending, orphans, failure).
"""

from __future__ import annotations

import asyncio
import socket
import ssl as _ssl
import struct
from typing import Any, Awaitable, Callable, Sequence

from statetier.protocol.errors import (
    ClientClosedError,
    InvalidRequest,
    MalformedFrame,
    ProtocolError,
    StatetierError,
    Unavailable,
)
from statetier.protocol.phases import ConnectionPhase, Event
from statetier.protocol.frames import (
    DEFAULT_MAX_FRAME,
    FLAG_ERROR,
    PROTOCOL_VERSIONS,
    Frame,
    FrameDecoder,
    Op,
    encode_frame,
    frame_too_large,
    hello_frame,
    raise_for_error,
)

from .endpoint import Endpoint, parse_url
from .handshake import DEFAULT_MAX_INFLIGHT, WindowFds, close_fds, hello_over_socket, hello_terms

CLIENT_NAME = "statetier-python/0.1"
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
WRITE_HIGH_WATER = 4 * 1024 * 1024
_LENGTH = struct.Struct("<I")  # the frame's leading length field (docs/frames.md)

Buffer = bytes | bytearray | memoryview
OrphanHandler = Callable[[Frame], "Awaitable[Any] | None"]


async def connect(
    url: str,
    *,
    tenant: str = "default",
    token: str | None = None,
    ssl: _ssl.SSLContext | None = None,
    shm: bool = True,
    timeout: float = 10.0,
    client_name: str = CLIENT_NAME,
) -> "Connection":
    """Open a connection and complete the handshake, or raise a typed error."""
    endpoint = parse_url(url)
    if endpoint.is_unix and ssl is not None:
        raise InvalidRequest("TLS is for tcp:// endpoints; a Unix socket is authenticated by the kernel")
    if endpoint.tls and ssl is None:
        ssl = _ssl.create_default_context()
    conn = Connection(endpoint)
    try:
        await asyncio.wait_for(conn._open(ssl, tenant, token, shm and endpoint.is_unix, client_name), timeout)
    except asyncio.TimeoutError as exc:
        conn._abort()
        raise Unavailable(f"no handshake with {url} within {timeout} s") from exc
    except BaseException:
        conn._abort()
        raise
    return conn


class Connection(asyncio.BufferedProtocol):
    """The client end of one daemon connection. Build it with ``connect()``."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.hello: dict = {}
        self.max_frame = DEFAULT_MAX_FRAME
        self.shm: WindowFds | None = None
        self._fds: list[int] = []  # received with HELLO_OK, not yet claimed
        self._loop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME)
        self._transport: asyncio.Transport | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._orphans: dict[int, OrphanHandler] = {}
        self._background: set[asyncio.Task] = set()
        self._next_id = 1
        self._slots = asyncio.Semaphore(DEFAULT_MAX_INFLIGHT)
        self._phase = ConnectionPhase()  # handshake → open → failed / closing → closed
        self._failure: BaseException | None = None  # why the connection is unusable
        self._is_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._lost = self._loop.create_future()

    # -- public -------------------------------------------------------------------------

    @property
    def is_usable(self) -> bool:
        return self._phase.reads_requests and self._failure is None and self._transport is not None

    async def request(
        self,
        op: Op,
        meta: dict,
        data: Buffer | Sequence[Buffer] = b"",
        *,
        on_orphan: OrphanHandler | None = None,
        on_unsent: Callable[[], None] | None = None,
    ) -> Frame:
        """Send one request and return its REPLY; raises the typed error of an ERROR reply.

        ``on_orphan`` gets the answer (a REPLY or an ERROR frame) to a request whose caller
        was cancelled after it was written; ``on_unsent`` is called instead when the
        request was never written (cancelled while waiting for a slot, or refused).
        """
        written = False
        try:
            self._raise_if_unusable()
            async with self._slots:
                self._raise_if_unusable()
                request_id = self._next_id
                self._next_id += 1
                future = self._loop.create_future()
                self._pending[request_id] = future
                try:
                    self._write(self._encode(op, request_id, meta, data))
                    written = True
                    if self._is_paused:
                        await self._drain()
                    frame = await future
                except asyncio.CancelledError:
                    if on_orphan is not None and written:
                        self._adopt_orphan(request_id, future, on_orphan)
                    raise
                finally:
                    self._pending.pop(request_id, None)
        except BaseException:
            if not written and on_unsent is not None:
                on_unsent()
            raise
        if frame.flags & FLAG_ERROR:
            raise_for_error(frame)
        return frame

    def request_and_forget(self, op: Op, meta: dict) -> None:
        """Send a best-effort request (a cleanup) in the background; its answer is ignored."""
        if self.is_usable:
            self._spawn(self.request(op, meta))

    def send_nowait(self, op: Op, meta: dict) -> None:
        """Write a best-effort request now, ahead of any later one; its answer is dropped.

        No in-flight slot is taken: past the daemon's cap it only stops reading for a while.
        For cleanups whose outcome changes nothing for the caller (a RELEASE after a copy).
        """
        if self.is_usable:
            request_id = self._next_id
            self._next_id += 1
            self._write(self._encode(op, request_id, meta, b""))

    async def close(self, timeout: float = 5.0) -> None:
        """Say GOODBYE and close; pending requests fail with ``ClientClosedError``."""
        if self._phase.is_closing:
            return
        if self._phase.is_gone:  # lost before: what is asked now is misuse, not an outage
            self._failure = ClientClosedError("the statetier client is closed")
        else:
            self._phase.advance(Event.CLOSE)
        transport = self._transport
        if transport is not None and not transport.is_closing():
            try:
                transport.writelines(encode_frame(Frame(Op.GOODBYE, 0, {})))
            except (RuntimeError, OSError):
                pass  # the transport is already going away
            transport.close()
        if transport is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._lost), timeout)
            except asyncio.TimeoutError:
                transport.abort()
        for task in list(self._background):
            task.cancel()

    # -- handshake ----------------------------------------------------------------------

    async def _open(self, ssl, tenant: str, token: str | None, want_shm: bool, client_name: str) -> None:
        endpoint = self.endpoint
        fields: dict[str, Any] = {"tenant": tenant, "client": client_name, "shm": want_shm}
        if token is not None:
            fields["token"] = token
        if want_shm:
            await self._open_unix_with_fds(fields)
            return
        try:
            if endpoint.is_unix:
                await self._loop.create_unix_connection(lambda: self, endpoint.path)
            else:
                assert endpoint.host is not None and endpoint.port is not None  # a TCP endpoint
                await self._loop.create_connection(lambda: self, endpoint.host, endpoint.port, ssl=ssl)
        except (OSError, _ssl.SSLError) as exc:
            raise Unavailable(f"cannot connect to the daemon at {endpoint}: {exc}") from exc
        future = self._loop.create_future()
        self._pending[0] = future
        try:
            self._write(encode_frame(hello_frame(PROTOCOL_VERSIONS, **fields)))
            frame = await future
        finally:
            self._pending.pop(0, None)
        self._accept_hello(frame)

    async def _open_unix_with_fds(self, fields: dict) -> None:
        """The handshake on a plain socket, so that HELLO_OK's descriptors are received;
        the transport takes the socket after."""
        try:
            sock, frames = await hello_over_socket(self._loop, self.endpoint, fields, self._decoder, self._fds)
            try:
                self._accept_hello(frames[0])
                await self._loop.create_unix_connection(lambda: self, sock=sock)
            except BaseException:
                sock.close()
                raise
        except BaseException:
            close_fds(self._fds)
            self._fds.clear()
            raise
        for extra in frames[1:]:
            self._dispatch(extra)

    def _accept_hello(self, frame: Frame) -> None:
        raise_for_error(frame)
        if frame.op is not Op.HELLO_OK:
            raise MalformedFrame(f"the daemon answered HELLO with {frame.op.name}")
        terms = hello_terms(frame.meta, self._fds)
        self.hello, self.max_frame, self.shm = terms.meta, terms.max_frame, terms.shm
        self._decoder.max_frame_size = max(self._decoder.max_frame_size, terms.max_frame)
        self._slots = asyncio.Semaphore(terms.max_inflight)
        self._phase.advance(Event.ADMIT)

    # -- writing ------------------------------------------------------------------------

    def _encode(self, op: Op, request_id: int, meta: dict, data) -> list:
        if not isinstance(data, (list, tuple)):
            return encode_frame(Frame(op, request_id, meta, data), self.max_frame)
        parts = [memoryview(p).cast("B") for p in data]
        parts = [p for p in parts if p.nbytes]
        if len(parts) <= 1:
            return encode_frame(Frame(op, request_id, meta, parts[0] if parts else b""), self.max_frame)
        head = encode_frame(Frame(op, request_id, meta), self.max_frame)[0]
        nbytes = sum(p.nbytes for p in parts)
        if len(head) + nbytes > self.max_frame:
            raise frame_too_large(len(head) + nbytes, self.max_frame)
        (length,) = _LENGTH.unpack_from(head)
        return [_LENGTH.pack(length + nbytes) + head[_LENGTH.size:], *parts]

    def _write(self, buffers: list) -> None:
        self._raise_if_unusable()
        transport = self._transport
        assert transport is not None  # checked by _raise_if_unusable
        if len(buffers) == 1:
            transport.write(buffers[0])  # one buffer: no list for the transport to walk
        else:
            transport.writelines(buffers)

    async def _drain(self) -> None:
        if not self._is_paused:
            return
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._drain_waiters:
                self._drain_waiters.remove(waiter)

    def _raise_if_unusable(self) -> None:
        if self._phase.is_closing:
            raise ClientClosedError("the statetier client is closed")
        if self._failure is not None:
            raise self._failure_for_caller()
        if self._transport is None:
            raise Unavailable("not connected")

    def _failure_for_caller(self) -> BaseException:
        """A fresh exception per caller (one raised object per traceback), caused by the failure."""
        failure = self._failure
        if isinstance(failure, ClientClosedError):
            return ClientClosedError(str(failure))
        fresh = type(failure)(failure.message) if isinstance(failure, StatetierError) else Unavailable(
            "connection to the daemon lost")
        fresh.__cause__ = failure
        return fresh

    def _adopt_orphan(self, request_id: int, future: asyncio.Future, on_orphan: OrphanHandler) -> None:
        """The caller of ``request_id`` was cancelled: its reply, now or later, goes to ``on_orphan``."""
        if self._pending.get(request_id) is future:
            self._orphans[request_id] = on_orphan  # not answered yet
        elif future.done() and not future.cancelled() and future.exception() is None:
            frame = future.result()  # answered, but the caller was cancelled before it woke up
            if self.is_usable:
                self._spawn(on_orphan(frame))

    # -- asyncio protocol callbacks -----------------------------------------------------

    def connection_made(self, transport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
                except OSError:
                    pass  # a smaller buffer only costs speed
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            frames = self._decoder.buffer_updated(nbytes)
        except ProtocolError as exc:
            self._fail(exc)
            if self._transport is not None:  # always: the bytes came through it
                self._transport.abort()
            return
        for frame in frames:
            self._dispatch(frame)

    def eof_received(self) -> bool:
        return False  # the daemon finished: close our side too

    def pause_writing(self) -> None:
        self._is_paused = True

    def resume_writing(self) -> None:
        self._is_paused = False
        self._wake_drainers(failed=False)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._phase.is_closing:
            self._fail(ClientClosedError("the statetier client was closed"))
        else:
            lost = Unavailable("connection to the daemon lost")
            lost.__cause__ = exc
            self._fail(lost)
        self._phase.advance(Event.LOSE)
        self._orphans.clear()
        if not self._lost.done():
            self._lost.set_result(None)

    # -- receiving ----------------------------------------------------------------------

    def _dispatch(self, frame: Frame) -> None:
        if frame.op is Op.PING and not frame.is_error:
            if self.is_usable:
                self._write(encode_frame(Frame(Op.PONG, frame.request_id, {})))
            return
        if frame.op is Op.GOODBYE:
            self._fail(_error_of(frame) if frame.is_error else Unavailable("the daemon closed the connection"))
            return
        future = self._pending.pop(frame.request_id, None)
        if future is not None:
            if not future.done():
                future.set_result(frame)
            return
        if frame.request_id == 0 and frame.is_error:
            self._fail(_error_of(frame))  # about the connection itself; the daemon closes it
            return
        handler = self._orphans.pop(frame.request_id, None)
        if handler is not None and self.is_usable:
            self._spawn(handler(frame))

    def _fail(self, error: BaseException) -> None:
        """Make the connection unusable and fail every pending request with ``error``."""
        if self._failure is None:
            self._failure = error
        if not self._phase.is_gone:
            self._phase.advance(Event.FAIL)
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self._failure_for_caller())
        self._wake_drainers(failed=True)

    def _wake_drainers(self, *, failed: bool) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                if failed:
                    waiter.set_exception(self._failure_for_caller())
                else:
                    waiter.set_result(None)

    def _spawn(self, awaitable) -> None:
        if awaitable is None:
            return
        task = asyncio.ensure_future(awaitable)
        self._background.add(task)
        task.add_done_callback(_forget_task(self._background))

    def _abort(self) -> None:
        if not self._phase.is_gone:
            self._phase.advance(Event.CLOSE)
        if self._transport is not None:
            self._transport.abort()
        for task in list(self._background):
            task.cancel()


def _error_of(frame: Frame) -> StatetierError:
    try:
        raise_for_error(frame)
    except StatetierError as exc:
        return exc
    return MalformedFrame(f"expected an error frame, got {frame.op.name}")


def _forget_task(tasks: set) -> Callable[[asyncio.Task], None]:
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: best-effort cleanup failures are not reported
    return done
