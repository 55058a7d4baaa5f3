"""The HELLO / HELLO_OK handshake: its terms, and its form that receives file descriptors.

- ``hello_terms(meta, fds)`` → ``HelloTerms`` (protocol version checked, ``max_frame``,
  ``max_inflight``, ``shm``): HELLO_OK's meta validated (``UnsupportedProtocol``,
  ``MalformedFrame``). With an ``shm`` offer and exactly two descriptors in ``fds``, they
  become the ``WindowFds``; any other descriptor is closed. ``fds`` is emptied unless it raises.
- ``WindowFds`` — the connection's put (read/write) and load (read-only) window
  descriptors with their sizes; the caller maps them (``shm.ClientWindows``) and closes them.
- ``await hello_over_socket(loop, endpoint, fields, decoder, fds)`` → ``(sock, frames)``:
  HELLO sent on a plain non-blocking Unix socket and read back with ``recvmsg``, so that the
  ``SCM_RIGHTS`` descriptors of HELLO_OK land in ``fds`` (an asyncio transport drops them);
  ``frames`` holds HELLO_OK and anything decoded after it. The socket is closed on failure;
  on success ``transport.Connection`` hands it to its transport.
- ``close_fds(fds)`` — close descriptors, ignoring those already gone.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
from dataclasses import dataclass
from typing import Iterable, cast

from statetier.protocol.errors import MalformedFrame, Unavailable, UnsupportedProtocol
from statetier.protocol.frames import (DEFAULT_MAX_FRAME, PROTOCOL_VERSIONS, Frame, FrameDecoder, encode_frame,
                                       hello_frame)

from .endpoint import Endpoint

DEFAULT_MAX_INFLIGHT = 256


@dataclass(frozen=True, slots=True)
class WindowFds:
    """The two windows HELLO_OK passed: put (read/write) and load (read-only) descriptors."""

    put_fd: int
    put_bytes: int
    load_fd: int
    load_bytes: int

    def close(self) -> None:
        close_fds((self.put_fd, self.load_fd))


@dataclass(frozen=True, slots=True)
class HelloTerms:
    """What the daemon granted: HELLO_OK's ``meta`` as sent, and its checked fields."""

    meta: dict
    max_frame: int
    max_inflight: int
    shm: WindowFds | None


def hello_terms(meta: dict, fds: list[int]) -> HelloTerms:
    version = meta.get("version")
    if version not in PROTOCOL_VERSIONS:
        raise UnsupportedProtocol(f"the daemon chose protocol version {version!r}")
    max_frame = meta.get("max_frame", DEFAULT_MAX_FRAME)
    inflight = meta.get("max_inflight") or DEFAULT_MAX_INFLIGHT
    if not isinstance(max_frame, int) or not isinstance(inflight, int) or inflight < 1:
        raise MalformedFrame("HELLO_OK needs integer max_frame and max_inflight")
    shm = meta.get("shm")
    windows = None
    if shm is not None:
        sizes = (shm.get("put_bytes"), shm.get("load_bytes")) if isinstance(shm, dict) else (None, None)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
            raise MalformedFrame("HELLO_OK shm must be {put_bytes: int, load_bytes: int} or null")
        if len(fds) == 2:
            put_bytes, load_bytes = cast(tuple[int, int], sizes)  # checked just above
            windows = WindowFds(fds[0], put_bytes, fds[1], load_bytes)
            fds.clear()
    close_fds(fds)  # anything not claimed (no shm offered, or not two descriptors)
    fds.clear()
    return HelloTerms(meta, max_frame, inflight, windows)


async def hello_over_socket(loop: asyncio.AbstractEventLoop, endpoint: Endpoint, fields: dict,
                            decoder: FrameDecoder, fds: list[int]) -> tuple[socket.socket, list[Frame]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        assert endpoint.path is not None  # a Unix socket's endpoint
        await loop.sock_connect(sock, endpoint.path)
        hello = b"".join(bytes(p) for p in encode_frame(hello_frame(PROTOCOL_VERSIONS, **fields)))
        await loop.sock_sendall(sock, hello)
        return sock, await _receive_hello(loop, sock, decoder, fds)
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot connect to the daemon at {endpoint}: {exc}") from exc
    except BaseException:
        sock.close()
        raise


async def _receive_hello(loop: asyncio.AbstractEventLoop, sock: socket.socket, decoder: FrameDecoder,
                         fds: list[int]) -> list[Frame]:
    frames: list[Frame] = []
    space = socket.CMSG_SPACE(8 * array.array("i").itemsize)
    while not frames:
        readable: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(sock.fileno(), wake)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())
        try:
            data, ancillary, _flags, _addr = sock.recvmsg(64 * 1024, space)
        except (BlockingIOError, InterruptedError):
            continue
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                fds.extend(received)
        if not data:
            raise Unavailable("the daemon closed the connection during the handshake")
        while data:
            buffer = decoder.get_buffer(len(data))
            n = min(len(buffer), len(data))
            buffer[:n] = data[:n]
            data = data[n:]
            frames.extend(decoder.buffer_updated(n))
    return frames


def close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
