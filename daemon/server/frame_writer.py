"""Flow-controlled frame writes on one transport, safe for borrowed payload views.

- ``FrameWriter(transport, max_frame)`` — owned by a ``Connection``, which forwards
  ``pause_writing``/``resume_writing``/``connection_lost`` to ``pause()``/``resume()``/
  ``lost()``. ``start()`` applies the write-buffer limits; the connection calls it once the
  writer is its own, because a TLS transport still holding handshake bytes (session
  tickets) calls ``pause_writing`` from inside ``set_write_buffer_limits``.
- ``await send(frame)`` — waits while the transport is paused, then hands the encoded
  frame to ``transport.writelines`` (the payload is not copied). ``ConnectionClosed`` when
  the connection is gone; a reply meta that cannot be encoded is an ``InternalError``.
- ``await wait_flushed()`` — returns once the transport holds none of the buffers written
  so far. An inline LOAD sends the leased payload view and releases the lease only after
  this, so the bytes on the wire are never bytes freed or reused under the lease.
- ``send_nowait(frame)`` — for connection-level frames written right before a close
  (HELLO_OK, a connection error, GOODBYE); it ignores flow control.
- ``write_eof()`` — half-closes after a connection error: the peer reads what was sent,
  then EOF. Later sends (a request task still finishing) raise ``ConnectionClosed``.

Write-buffer limits are chosen so that "the transport holds unsent bytes" is exactly
"writing is paused": ``resume_writing`` then means every buffer handed to ``writelines``
went to the kernel and the transport keeps no reference to it. Plain sockets (asyncio,
uvloop) pause when size > high, the SSL transports when size >= high, hence high = 1
there. The 4 MiB kernel buffer keeps the stream full while a writer waits. Measured:
uvloop pins a memoryview it could not send at once (asyncio 3.11 copies it); 2 MiB
replies over a Unix socket ran at 2.2-2.8 GB/s sending the view and waiting for the
drain, 1.4-1.6 GB/s copying each payload into ``bytes`` first.
"""

from __future__ import annotations

import asyncio

from statetier.protocol.errors import InternalError, MalformedFrame
from statetier.protocol.frames import Frame, encode_frame

_PLAIN_WRITE_LIMITS = (0, 0)  # (high, low)
_TLS_WRITE_LIMITS = (1, 0)


class ConnectionClosed(Exception):
    """The peer went away (or the connection failed) while a frame was being sent."""


class FrameWriter:
    """See the module docstring."""

    def __init__(self, transport: asyncio.Transport, max_frame: int) -> None:
        self._transport = transport
        self._max_frame = max_frame
        is_tls = transport.get_extra_info("sslcontext") is not None
        self._limits = _TLS_WRITE_LIMITS if is_tls else _PLAIN_WRITE_LIMITS
        self._writable = asyncio.Event()
        self._writable.set()
        self._lost = False
        self._is_eof_written = False

    def start(self) -> None:
        self._transport.set_write_buffer_limits(*self._limits)

    def pause(self) -> None:
        self._writable.clear()

    def resume(self) -> None:
        self._writable.set()

    def lost(self) -> None:
        self._lost = True
        self._writable.set()  # wakes writers, which then see the connection is gone

    async def send(self, frame: Frame) -> None:
        chunks = self._encode(frame)
        while not self._writable.is_set():
            await self._writable.wait()
        if self._is_closed_for_writing():
            raise ConnectionClosed()
        self._transport.writelines(chunks)

    def send_nowait(self, frame: Frame) -> None:
        if not self._is_closed_for_writing():
            chunks = self._encode(frame)
            if len(chunks) == 1:
                self._transport.write(chunks[0])
            else:
                self._transport.writelines(chunks)

    def write_eof(self) -> None:
        if not self._is_closed_for_writing():
            self._is_eof_written = True
            self._transport.write_eof()

    def _is_closed_for_writing(self) -> bool:
        return self._lost or self._is_eof_written or self._transport.is_closing()

    async def wait_flushed(self) -> None:
        while not self._lost and self._transport.get_write_buffer_size() > 0:
            if self._writable.is_set():
                # Unsent bytes always pause writing under our limits; re-applying them
                # makes the transport re-check, should it not have done so yet.
                self._transport.set_write_buffer_limits(*self._limits)
            await self._writable.wait()

    def _encode(self, frame: Frame) -> list:
        try:
            return encode_frame(frame, self._max_frame)
        except MalformedFrame as exc:
            raise InternalError(f"the daemon built an unencodable frame: {exc.message}") from exc
