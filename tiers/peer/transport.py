"""The seam every daemon-to-daemon transfer goes through, and its default: TCP.

- ``PeerTransport`` — what the peer tier pulls with: ``pull(address, object_id, tenant_tag,
  into)`` fills ``into`` (the object's size exactly) with the object the owner at
  ``address`` holds, or raises: ``NotFound`` (the owner no longer holds it), ``Forbidden``
  (not the tenant's), ``PeerLost`` (refused, broken off, or past the deadline: what
  ``into`` holds then is never served; a ``PeerLost`` chained from ``ConnectionRefusedError``
  says no process listens at ``address``). ``answered_by(address)`` is the owner id that
  answered the last handshake there (None before one). ``forget(address)`` drops the idle
  connections to it; ``close()`` all of them. A NIXL transport (the owner writing into a
  registered window) is a second implementation.
- ``TcpTransport(keyring, options, faults=None)`` — statetier's frames (``tiers.peer.wire``)
  over TCP, each connection authenticated with the cluster keyring; the bytes received
  straight into ``into`` (``sock_recv_into``), large socket buffers, a few idle connections
  kept per owner. A connection interrupted mid-frame is closed, never reused. Within the
  pull's deadline (``pull_timeout``, the whole of it): a pooled connection found closed is
  dialled again at once (``redialled``), a pull broken off on a fresh connection is tried
  again after a backoff (``retried``, ``RETRIES`` tries in all); a refused dial is not
  retried (it is evidence, for the tier). Both counted in ``faults`` (``tiers.peer.faults``).
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Protocol

from statetier.protocol.errors import Forbidden, NotFound, PeerLost, Unauthorized
from statetier.protocol.keyring import Keyring
from statetier.protocol.lru import BoundedLru

from . import wire
from .faults import PeerFaults
from .options import PeerTierOptions

RETRIES = 4  # tries of one pull on fresh connections, the deadline permitting
RETRY_FIRST_DELAY = 0.05  # seconds before the second try; doubled each time
RETRY_MAX_DELAY = 0.4
OWNERS = 4096  # addresses whose last answering owner id is remembered


class PeerTransport(Protocol):
    async def pull(self, address: str, object_id: bytes, tenant_tag: bytes, into: memoryview) -> None: ...

    def answered_by(self, address: str) -> str | None: ...

    def forget(self, address: str) -> None: ...

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
    def __init__(self, keyring: Keyring, options: PeerTierOptions, faults: PeerFaults | None = None) -> None:
        self._keyring = keyring
        self._options = options
        self._idle: dict[str, list[_PeerConnection]] = {}
        self._owners: BoundedLru[str, str] = BoundedLru(OWNERS)  # address → the owner id its last handshake named
        self.faults = faults if faults is not None else PeerFaults()
        self.pulls = 0
        self.bytes_pulled = 0

    def answered_by(self, address: str) -> str | None:
        return self._owners.peek(address)

    async def pull(self, address: str, object_id: bytes, tenant_tag: bytes, into: memoryview) -> None:
        try:
            async with asyncio.timeout(self._options.pull_timeout):
                await self._pull_retrying(address, object_id, tenant_tag, into)
        except TimeoutError as exc:
            raise PeerLost(f"peer {address} did not answer the pull of {object_id.hex()} within "
                           f"{self._options.pull_timeout} s") from exc
        except OSError as exc:
            raise PeerLost(f"peer {address} broke off the pull of {object_id.hex()}: {exc}") from exc
        self.pulls += 1
        self.bytes_pulled += len(into)

    async def _pull_retrying(self, address: str, object_id: bytes, tenant_tag: bytes, into: memoryview) -> None:
        """``_pull_once`` until it lands, ``RETRIES`` tries with a doubling backoff between them
        (the caller's deadline cuts it short); a refused dial ends it at once."""
        delay = RETRY_FIRST_DELAY
        for tries_left in range(RETRIES - 1, -1, -1):
            try:
                return await self._pull_once(address, object_id, tenant_tag, into)
            except ConnectionRefusedError:
                raise
            except OSError as exc:
                if not tries_left:
                    raise
                self.faults.count("retried", "peer %s broke off the pull of %s (%s): pulled again in %.0f ms, "
                                  "within the pull's deadline", address, object_id.hex(), exc, delay * 1e3)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_DELAY)

    async def _pull_once(self, address: str, object_id: bytes, tenant_tag: bytes, into: memoryview) -> None:
        """One pull on a pooled connection, or on a fresh one when none is idle or the pooled
        one is found closed (the answer refills ``into`` from its start)."""
        session = self._take_idle(address)
        if session is not None:
            try:
                return await self._exchange_on(address, session, object_id, tenant_tag, into)
            except OSError as exc:
                self.forget(address)  # idle as long as this one: as likely closed
                self.faults.count("redialled", "peer %s: a pooled connection was found closed (%s): dialling "
                                  "a fresh one for the pull of %s", address, exc, object_id.hex())
        await self._exchange_on(address, await self._connect(address), object_id, tenant_tag, into)

    async def _exchange_on(self, address: str, session: _PeerConnection, object_id: bytes, tenant_tag: bytes,
                           into: memoryview) -> None:
        try:
            await self._exchange(session, object_id, tenant_tag, into)
        except BaseException:
            session.close()  # interrupted mid-frame: never reused
            raise
        self._give_back(address, session)

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
            key, owner_id = await self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        self._owners.put(address, owner_id)
        return _PeerConnection(sock, key)

    async def _handshake(self, sock: socket.socket) -> tuple[bytes, str]:
        """The session key and the owner id of the process that answered."""
        loop = asyncio.get_running_loop()
        active = self._keyring.active
        key = wire.auth_key(active)
        nonce_p = os.urandom(wire.NONCE_BYTES)
        await loop.sock_sendall(sock, wire.MAGIC_OWNER + active.key_id + nonce_p)
        welcome = bytearray(wire.WELCOME_BYTES)
        await recv_exact(sock, memoryview(welcome))
        if welcome == wire.REFUSED:
            raise Unauthorized("peer: the owner does not know this daemon's key: not the same cluster keyring")
        length = bytearray(1)
        await recv_exact(sock, memoryview(length))
        owner_id = bytearray(length[0])
        await recv_exact(sock, memoryview(owner_id))
        owner_key_id, nonce_o, proof = bytes(welcome[:8]), bytes(welcome[8:40]), bytes(welcome[40:])
        owner_key = wire.key_for(self._keyring, owner_key_id) if owner_key_id != active.key_id else key
        if wire.owner_proof(owner_key, nonce_p, nonce_o, bytes(owner_id)) != proof:
            raise Unauthorized("peer: the owner did not prove it holds this cluster's keyring")
        await loop.sock_sendall(sock, wire.mac(key, b"puller", nonce_p, nonce_o))
        return wire.session_key(key, nonce_p, nonce_o), owner_id.decode(errors="replace")

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

