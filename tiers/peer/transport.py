"""The seam every daemon-to-daemon transfer goes through, and its default: TCP.

- ``PeerTransport`` — what the peer tier pulls with: ``pull(address, object_id, tenant_tag,
  into)`` fills ``into`` (the object's size exactly) with the object the owner at
  ``address`` holds, or raises: ``NotFound`` (the owner no longer holds it), ``Forbidden``
  (not the tenant's), ``PeerLost`` (refused, broken off, or past the deadline: what
  ``into`` holds then is never served; a ``PeerLost`` chained from ``ConnectionRefusedError``
  says no process listens at ``address``). ``answered_by(address)`` is the owner id that
  answered the last handshake there (None before one). ``forget(address)`` drops the idle
  connections to it; ``close()`` all of them. A NIXL transport (the owner writing into a
  registered window) is a second implementation. ``pull_many(address, items, landed=)`` pulls a
  batch of one owner's objects (``PullItem``: object id, tenant tag, ``into``) with one
  request, the owner streaming them back to back: per item, in order, None (landed) or its
  ``NotFound`` / ``Forbidden`` / ``PeerLost`` (every item not landed when the connection
  broke), each told to ``landed(index, error)`` as soon as it is known, so landing overlaps
  receiving.
- ``TcpTransport(keyring, options, faults=None)`` — statetier's frames (``tiers.peer.wire``)
  over TCP, each connection authenticated with the cluster keyring; the bytes received
  straight into ``into`` (``sock_recv_into``), large socket buffers, a few idle connections
  kept per owner. A connection interrupted mid-frame is closed, never reused. Within the
  pull's deadline (``pull_timeout``, the whole of it): a pooled connection found closed is
  dialled again at once (``redialled``), a pull broken off on a fresh connection is tried
  again after a backoff (``retried``, ``RETRIES`` tries in all); a refused dial is not
  retried (it is evidence, for the tier). Both counted in ``faults`` (``tiers.peer.faults``).
  A batch is one ``PULL_MANY`` (``tiers.peer.wire``) per ``MANY_AT_MOST`` objects, each
  object's deadline the pull's; a pooled connection that fails before the batch's first
  answer is dialled again once (``redialled``); an owner that predates ``PULL_MANY`` is
  pulled from one object at a time.
  With ``options.encrypt`` every pull asks for its answer sealed (``wire.SEALED``): each chunk
  received into a scratch buffer of the connection and decrypted from there straight into
  ``into`` (``tiers.peer.sealing``: one pass more than the clear path, nothing else); a chunk
  that does not verify (``sealing.Altered``) is a transfer broken off: the connection closed,
  the object never served, pulled again on a fresh one (``retried``, never ``redialled``;
  ``PeerLost`` once the tries are spent); an answer in the clear (an owner that predates
  sealing) is ``PeerLost``, the connection closed unread.
  Without it the clear path is as it was.
"""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from statetier.protocol.errors import Forbidden, NotFound, PeerLost, StatetierError, Unauthorized
from statetier.protocol.keyring import Keyring
from statetier.protocol.lru import BoundedLru

from . import sealing, wire
from .faults import PeerFaults
from .options import PeerTierOptions

RETRIES = 4  # tries of one pull on fresh connections, the deadline permitting
RETRY_FIRST_DELAY = 0.05  # seconds before the second try; doubled each time
RETRY_MAX_DELAY = 0.4
OWNERS = 4096  # addresses whose last answering owner id is remembered


@dataclass(frozen=True, slots=True)
class PullItem:
    """One object of a ``pull_many``: the bytes land in ``into`` (the object's size exactly)."""

    object_id: bytes
    tenant_tag: bytes
    into: memoryview


#: told each item's outcome as soon as it is known: (its index, None when landed, else its error)
Landed = Callable[[int, StatetierError | None], None]


class PeerTransport(Protocol):
    faults: PeerFaults  # what it met: redials, retries (the tier counts its fences there too)
    pulls: int  # objects landed
    bytes_pulled: int

    async def pull(self, address: str, object_id: bytes, tenant_tag: bytes, into: memoryview) -> None: ...

    async def pull_many(self, address: str, items: Sequence[PullItem],
                        landed: Landed | None = None) -> list[StatetierError | None]: ...

    def answered_by(self, address: str) -> str | None: ...

    async def start(self, server: Any) -> None:
        """Whatever it needs beside the owner's listener (NIXL: its agent, its metadata in the
        directory, the listener's EXPOSE); TCP needs nothing."""

    def stats(self) -> dict[str, int]:
        """Its own counters for the tier's stats (NIXL: reads, inline answers …); TCP: none."""

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
        self._channel: sealing.Channel | None = None  # made at the first sealed answer
        self._scratch = memoryview(b"")

    async def receive(self, status: int, object_id: bytes, into: memoryview, sealed: bool) -> None:
        """An ``OK`` or ``OK_SEALED`` answer's bytes (``len(into)`` of them) into ``into``; ``sealed``:
        the pull asked for them sealed, and an answer in the clear is ``PeerLost`` (unread)."""
        if status == wire.OK:
            if sealed:
                raise PeerLost(f"the peer answered the pull of {object_id.hex()} in the clear, and this daemon "
                               "takes pulls encrypted only (peers.encrypt): an owner that predates it")
            return await recv_exact(self.sock, into)
        await self._open_into(object_id, into)

    async def _open_into(self, object_id: bytes, into: memoryview) -> None:
        """A sealed object, each chunk received into the scratch buffer and decrypted from there
        into ``into``; ``sealing.Altered`` at the first chunk that does not verify."""
        if self._channel is None:
            self._channel = sealing.Channel(self.key)
            self._scratch = memoryview(bytearray(sealing.CHUNK + sealing.TAG))
        aad = sealing.associated(object_id, len(into))
        for start, end in sealing.chunks(len(into)):
            chunk = self._scratch[: end - start + sealing.TAG]
            await recv_exact(self.sock, chunk)
            self._channel.open(aad, chunk, into[start:end])

    def close(self) -> None:
        self.sock.close()


class _Predates(Exception):
    """The owner answered a PULL_MANY as a pull of an unknown object: it predates batches."""


class _Batch:
    """A ``pull_many`` under way: each item's outcome, told to ``landed`` once known."""

    def __init__(self, items: Sequence[PullItem], landed: Landed | None) -> None:
        self.items = items
        self.out: list[StatetierError | None] = [None] * len(items)
        self.settled = 0  # items[:settled] are known
        self._landed = landed
        self.retries_left = RETRIES - 1  # fresh connections broken off, tried again
        self.delay = RETRY_FIRST_DELAY

    def settle(self, error: StatetierError | None) -> None:
        index = self.settled
        self.out[index] = error
        self.settled += 1
        if self._landed is not None:
            self._landed(index, error)

    def lose_the_rest(self, error: StatetierError) -> None:
        while self.settled < len(self.items):
            self.settle(error)


class TcpTransport:
    def __init__(self, keyring: Keyring, options: PeerTierOptions, faults: PeerFaults | None = None) -> None:
        self._keyring = keyring
        self._options = options
        self._idle: dict[str, list[_PeerConnection]] = {}
        self._one_by_one: set[str] = set()  # owners that predate PULL_MANY
        self._owners: BoundedLru[str, str] = BoundedLru(OWNERS)  # address → the owner id its last handshake named
        self.faults = faults if faults is not None else PeerFaults()
        self.pulls = 0
        self.bytes_pulled = 0
        self.batches = 0

    def answered_by(self, address: str) -> str | None:
        return self._owners.peek(address)

    async def start(self, server: Any) -> None:  # the owner's ``PeerServer`` (serve imports this module)
        return None  # plain TCP needs nothing beside the listener

    def stats(self) -> dict[str, int]:
        return {}

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

    async def pull_many(self, address: str, items: Sequence[PullItem],
                        landed: Landed | None = None) -> list[StatetierError | None]:
        batch = _Batch(items, landed)
        while batch.settled < len(items):
            if address in self._one_by_one:
                await self._pull_one_by_one(address, batch)
                break
            try:
                await self._pull_batch(address, batch, items[batch.settled : batch.settled + wire.MANY_AT_MOST])
            except _Predates:
                self._one_by_one.add(address)
        return batch.out

    async def _pull_batch(self, address: str, batch: _Batch, chunk: Sequence[PullItem]) -> None:
        """One PULL_MANY of ``chunk`` (the batch's next items); a pooled connection that fails
        before the first answer is dialled again once (``redialled``); a fresh one broken off is
        tried again after a backoff (``retried``: ``RETRIES`` tries for the whole batch, the
        caller asking again for what is left). A refused dial, a deadline passed or a second
        failure: the rest ``PeerLost`` (the refusal chained: evidence for the tier)."""
        first = batch.settled
        for attempt in (0, 1):
            session = self._take_idle(address) if attempt == 0 else None
            reused = session is not None
            try:
                async with asyncio.timeout(self._options.pull_timeout) as deadline:
                    session = session or await self._connect(address)
                    try:
                        await self._exchange_many(session, batch, chunk, deadline)
                    except BaseException:
                        session.close()  # interrupted mid-frame: never reused
                        raise
                    self._give_back(address, session)
                    self.batches += 1
                    return
            except TimeoutError:
                lost: StatetierError = PeerLost(f"peer {address} did not answer a pull within "
                                                f"{self._options.pull_timeout} s")
            except OSError as exc:
                if reused and batch.settled == first and not isinstance(exc, sealing.Altered):
                    self.forget(address)  # idle as long as this one: as likely closed
                    self.faults.count("redialled", "peer %s: a pooled connection was found closed (%s): dialling "
                                      "a fresh one for a batch of %d pulls", address, exc, len(chunk))
                    continue
                if not isinstance(exc, ConnectionRefusedError) and batch.retries_left:
                    batch.retries_left -= 1
                    self.faults.count("retried", "peer %s broke off a batch of pulls (%s): the %d not landed "
                                      "pulled again in %.0f ms", address, exc, len(batch.items) - batch.settled,
                                      batch.delay * 1e3)
                    await asyncio.sleep(batch.delay)
                    batch.delay = min(2 * batch.delay, RETRY_MAX_DELAY)
                    return  # the caller asks again for what is left
                lost = PeerLost(f"peer {address} broke off a batch of pulls: {exc}")
                lost.__cause__ = exc
            except (PeerLost, Unauthorized) as exc:
                lost = exc
            batch.lose_the_rest(lost)
            return

    async def _exchange_many(self, session: _PeerConnection, batch: _Batch, chunk: Sequence[PullItem],
                             deadline: asyncio.Timeout) -> None:
        loop = asyncio.get_running_loop()
        session.seq += 1
        sealed = self._options.encrypt
        await loop.sock_sendall(session.sock, wire.pack_pull_many(
            session.key, [(i.object_id, i.tenant_tag, wire.asking(len(i.into), sealed)) for i in chunk],
            session.seq))
        status, length = await self._answer_head(session)
        if status == wire.NOT_HERE and length == 0:
            raise _Predates()
        if status != wire.BATCH or length != len(chunk):
            raise PeerLost(f"the peer answered a PULL_MANY of {len(chunk)} with status {status}, {length}")
        for item in chunk:
            status, length = await self._answer_head(session)
            if status in (wire.OK, wire.OK_SEALED) and length == len(item.into):
                await session.receive(status, item.object_id, item.into, sealed)
                self.pulls += 1
                self.bytes_pulled += length
                batch.settle(None)
            elif status in (wire.NOT_HERE, wire.FORBIDDEN) and length == 0:
                batch.settle(NotFound(f"the peer no longer holds {item.object_id.hex()}") if status == wire.NOT_HERE
                             else Forbidden(f"the peer refused {item.object_id.hex()} to this tenant"))
            else:
                raise PeerLost(f"the peer answered the pull of {item.object_id.hex()} with status {status}, "
                               f"{length} bytes for {len(item.into)}")
            deadline.reschedule(loop.time() + self._options.pull_timeout)  # each object its own deadline

    async def _answer_head(self, session: _PeerConnection) -> tuple[int, int]:
        head = bytearray(wire.ANSWER.size)
        await recv_exact(session.sock, memoryview(head))
        status, length = wire.ANSWER.unpack(head)
        return status, length

    async def _pull_one_by_one(self, address: str, batch: _Batch) -> None:
        """The batch's items not settled yet, one pull each (an owner that predates PULL_MANY)."""
        while batch.settled < len(batch.items):
            item = batch.items[batch.settled]
            try:
                await self.pull(address, item.object_id, item.tenant_tag, item.into)
                batch.settle(None)
            except (NotFound, Forbidden) as exc:
                batch.settle(exc)
            except (PeerLost, Unauthorized) as exc:
                batch.lose_the_rest(exc)

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
            except sealing.Altered:
                raise  # not a closed connection: a transfer damaged, tried again after a backoff
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
        sealed = self._options.encrypt
        await loop.sock_sendall(session.sock, wire.pack_pull(session.key, object_id, tenant_tag,
                                                             wire.asking(len(into), sealed), session.seq))
        head = bytearray(wire.ANSWER.size)
        await recv_exact(session.sock, memoryview(head))
        status, length = wire.ANSWER.unpack(head)
        if status == wire.NOT_HERE:
            raise NotFound(f"the peer no longer holds {object_id.hex()}")
        if status == wire.FORBIDDEN:
            raise Forbidden(f"the peer refused {object_id.hex()} to this tenant")
        if status not in (wire.OK, wire.OK_SEALED) or length != len(into):
            raise PeerLost(f"the peer answered the pull of {object_id.hex()} with status {status}, "
                           f"{length} bytes for {len(into)}")
        await session.receive(status, object_id, into, sealed)

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

