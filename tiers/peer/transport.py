"""The seam every daemon-to-daemon transfer goes through, and its default: TCP.

- ``PeerTransport`` — what the peer tier pulls with: ``pull(address, object_id, tenant_tag,
  into)`` fills ``into`` (the object's size exactly) with the object the owner at
  ``address`` holds, or raises: ``NotFound`` (the owner no longer holds it), ``Forbidden``
  (not the tenant's), ``PeerLost`` (refused, broken off, or past the deadline: what
  ``into`` holds then is never served). ``close()`` drops its connections. A NIXL
  transport (the owner writing into a registered window) is a second implementation.
- ``TcpTransport(keyring, options)`` — statetier's frames (``tiers.peer.wire``) over TCP,
  each connection authenticated with the cluster keyring; the bytes received straight into
  ``into`` (``sock_recv_into``), large socket buffers, a few idle connections kept per
  owner. A connection interrupted mid-frame is closed, never reused.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Protocol

from statetier.protocol.errors import Forbidden, NotFound, PeerLost, Unauthorized
from statetier.protocol.keyring import Keyring

from . import wire
from .options import PeerTierOptions


class PeerTransport(Protocol):
    async def pull(self, address: str, object_id: bytes, tenant_tag: bytes, into: memoryview) -> None: ...

    async def close(self) -> None: ...


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)


async def recv_exact(sock: socket.socket, view: memoryview) -> None:
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionResetError("the peer closed the connection")
        got += n


class _PeerConnection:
    """One authenticated connection to an owner."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock = sock
        self.key = key
        self.seq = 0

    def close(self) -> None:
        self.sock.close()


class TcpTransport:
    def __init__(self, keyring: Keyring, options: PeerTierOptions) -> None:
        self._keyring = keyring
        self._options = options
        self._idle: dict[str, list[_PeerConnection]] = {}
        self.pulls = 0
        self.bytes_pulled = 0

    async def pull(self, address: str, object_id: bytes, tenant_tag: bytes, into: memoryview) -> None:
        try:
            async with asyncio.timeout(self._options.pull_timeout):
                session = self._take_idle(address) or await self._connect(address)
                try:
                    await self._exchange(session, object_id, tenant_tag, into)
                except BaseException:
                    session.close()  # interrupted mid-frame: never reused
                    raise
                self._give_back(address, session)
        except TimeoutError as exc:
            raise PeerLost(f"peer {address} did not answer the pull of {object_id.hex()} within "
                           f"{self._options.pull_timeout} s") from exc
        except OSError as exc:
            raise PeerLost(f"peer {address} broke off the pull of {object_id.hex()}: {exc}") from exc
        self.pulls += 1
        self.bytes_pulled += len(into)

    async def _exchange(self, session: _PeerConnection, object_id: bytes, tenant_tag: bytes, into: memoryview) -> None:
        loop = asyncio.get_running_loop()
        session.seq += 1
        await loop.sock_sendall(session.sock, wire.pack_pull(session.key, object_id, tenant_tag, len(into),
                                                             session.seq))
        head = bytearray(wire.ANSWER.size)
        await recv_exact(session.sock, memoryview(head))
        status, length = wire.ANSWER.unpack(head)
        if status == wire.NOT_HERE:
            raise NotFound(f"the peer no longer holds {object_id.hex()}")
        if status == wire.FORBIDDEN:
            raise Forbidden(f"the peer refused {object_id.hex()} to this tenant")
        if status != wire.OK or length != len(into):
            raise PeerLost(f"the peer answered the pull of {object_id.hex()} with status {status}, "
                           f"{length} bytes for {len(into)}")
        await recv_exact(session.sock, into)

    async def _connect(self, address: str) -> _PeerConnection:
        loop = asyncio.get_running_loop()
        host, port = split_address(address)
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            tune(sock, self._options.socket_buffer_bytes)
            await loop.sock_connect(sock, sockaddr)
            key = await self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        return _PeerConnection(sock, key)

    async def _handshake(self, sock: socket.socket) -> bytes:
        loop = asyncio.get_running_loop()
        active = self._keyring.active
        key = wire.auth_key(active)
        nonce_p = os.urandom(wire.NONCE_BYTES)
        await loop.sock_sendall(sock, wire.MAGIC + active.key_id + nonce_p)
        welcome = bytearray(wire.WELCOME_BYTES)
        await recv_exact(sock, memoryview(welcome))
        if welcome == wire.REFUSED:
            raise Unauthorized("peer: the owner does not know this daemon's key: not the same cluster keyring")
        owner_key_id, nonce_o, proof = bytes(welcome[:8]), bytes(welcome[8:40]), bytes(welcome[40:])
        owner_key = wire.key_for(self._keyring, owner_key_id) if owner_key_id != active.key_id else key
        if wire.mac(owner_key, b"owner", nonce_p, nonce_o) != proof:
            raise Unauthorized("peer: the owner did not prove it holds this cluster's keyring")
        await loop.sock_sendall(sock, wire.mac(key, b"puller", nonce_p, nonce_o))
        return wire.session_key(key, nonce_p, nonce_o)

    def _take_idle(self, address: str) -> _PeerConnection | None:
        idle = self._idle.get(address)
        return idle.pop() if idle else None

    def _give_back(self, address: str, session: _PeerConnection) -> None:
        idle = self._idle.setdefault(address, [])
        if len(idle) < self._options.idle_connections:
            idle.append(session)
        else:
            session.close()

    def forget(self, address: str) -> None:
        """Drop the idle connections to an owner found lost."""
        for session in self._idle.pop(address, []):
            session.close()

    async def close(self) -> None:
        for address in list(self._idle):
            self.forget(address)

