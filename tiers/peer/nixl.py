"""NIXL as the fabric transport: the bytes read from the owner's registered memory by RDMA
(UCX: InfiniBand/RoCE, NVLink, EFA, or plain TCP), the control on the peer connection.

- ``make_transport(name, keyring, options, arena) -> PeerTransport | None`` — the selection of
  ``peers.transport``: ``"tcp"`` → None (the peer tier's ``TcpTransport``), ``"nixl"`` → a
  ``NixlTransport``, or ``ConfigError`` naming ``peers.transport`` when ``nixl_cu12`` does not
  import (the ``nixl`` extra is not installed).
- ``NixlTransport(keyring, options, arena)`` — a ``TcpTransport`` (its authenticated, pooled
  connections, deadlines and retries) whose pull asks the owner to *expose* the object
  (``tiers.peer.wire``: EXPOSE, then the object's PULL): the owner leases it and answers its
  address in its registered arena and its agent name; the puller adds that agent once (its
  metadata from the directory, ``st:peer:nixl:{owner id}``, refused unless signed with the
  cluster keyring: ``tiers.peer.nixlmeta``), READs the bytes straight into ``into`` and sends
  DONE, which releases the owner's lease (so does the connection's end). ``PeerTier.read``
  verifies ``into`` as after any pull (``open_sealed``). An object the owner holds outside its
  registered arena comes back as bytes on the connection (``inline``); an owner without NIXL
  answers the head ``NOT_HERE`` and the object as a TCP pull (``tcp_owner``). ``pull_many``:
  a batch of one owner's objects, pulled in turn.
  ``start(server)`` (from ``PeerTier.start``): the agent (named by the owner id), the arena
  registered once as DRAM, the signed metadata published (again every third of the TTL, at
  most ``RENEW_SECONDS``: a Redis restarted empty has it back within that),
  ``server.fabric`` set so the listener answers EXPOSE. An ``into`` outside the registered
  arena is registered for its pull alone (``registered_per_pull``).
- ``NixlFabric`` — the owner's side of EXPOSE (``PeerServer`` calls ``expose``).

Why READ, not the owner WRITEing into the puller's window: the puller's ``into`` may lie
anywhere (a promotion's reservation, a client's window, a fresh buffer), and registering it
is a local act before a READ, while a WRITE would need the puller's fresh metadata at the
owner for every new registration; the owner's bytes lie in the one arena it registered at
start. The lease is held from the EXPOSE answer to DONE (or the connection's end, which
every failed or timed-out pull causes): the owner's bytes cannot move during the READ.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable, Protocol, Sequence

from statetier.protocol.errors import ConfigError, Forbidden, NotFound, PeerLost, StatetierError, Unauthorized
from statetier.protocol.keyring import Keyring
from statetier.tiers.memory.rawmemory import exported, exported_for_write

from . import nixlmeta, wire
from .nixlagent import NixlAgent, importable
from .options import PeerTierOptions
from .serve import PeerServer
from .faults import PeerFaults
from .transport import PeerTransport, TcpTransport, _PeerConnection, recv_exact

log = logging.getLogger("statetier.peer.nixl")

RENEW_SECONDS = 10.0  # the metadata published again at least this often


class _Item(Protocol):
    """One object of a ``pull_many`` (``tiers.peer.transport.PullItem``)."""

    @property
    def object_id(self) -> bytes: ...

    @property
    def tenant_tag(self) -> bytes: ...

    @property
    def into(self) -> memoryview: ...


class Arena(Protocol):
    @property
    def arena_view(self) -> memoryview: ...


def make_transport(name: str, keyring: Keyring, options: PeerTierOptions,
                   arena: Arena | None) -> PeerTransport | None:
    if name == "tcp":
        return None
    if name != "nixl":
        raise ConfigError(f'peers.transport: {name!r} is not one of "tcp", "nixl"')
    why = importable()
    if why is not None:
        raise ConfigError(f'peers.transport = "nixl" needs NIXL in this Python (pip install '
                          f'"statetier[nixl]", and UCX for the fabric): nixl_cu12 does not import: {why}')
    return NixlTransport(keyring, options, arena)


class NixlTransport(TcpTransport):
    def __init__(self, keyring: Keyring, options: PeerTierOptions, arena: Arena | None,
                 faults: PeerFaults | None = None) -> None:
        super().__init__(keyring, options, faults)
        self._arena = arena
        self._nixl_keyring = keyring
        self.agent: NixlAgent | None = None
        self.board = nixlmeta.MetadataBoard(options.redis_url, options.ttl_seconds)
        self._remotes: set[str] = set()
        self._renew: asyncio.Task[None] | None = None
        self.exposed = 0  # pulls read with NIXL
        self.inline = 0  # answered as bytes on the connection (outside the owner's arena)
        self.tcp_owner = 0  # pulled from an owner without NIXL
        self.registered_per_pull = 0  # an ``into`` outside the registered arena
        self.metadata_refused = 0

    # ---------------------------------------------------------------- start and stop
    async def start(self, server: PeerServer) -> None:
        agent = self.agent = NixlAgent(self._options.owner_id)
        if self._arena is not None:
            with exported(self._arena.arena_view) as (address, length):
                agent.register(address, length)
        await self.board.start()
        blob = nixlmeta.sign(self._nixl_keyring, agent.name, agent.metadata())
        await self._publish(blob)
        ttl = self._options.ttl_seconds
        self._renew = asyncio.create_task(self._renew_every(min(ttl / 3, RENEW_SECONDS) if ttl else RENEW_SECONDS,
                                                            blob))
        server.fabric = NixlFabric(agent, self._options)

    async def _publish(self, blob: bytes) -> None:
        assert self.agent is not None
        try:
            await self.board.publish(self.agent.name, blob)
        except StatetierError as exc:  # Redis away: pulls from here wait for the next renewal
            log.warning("NIXL metadata of %s not published in the directory: %s", self.agent.name, exc)

    async def _renew_every(self, seconds: float, blob: bytes) -> None:
        """Published again every ``seconds``: before its TTL ends, and soon after Redis restarted empty."""
        while True:
            await asyncio.sleep(seconds)
            await self._publish(blob)

    async def close(self) -> None:
        if self._renew is not None:
            self._renew.cancel()
            await asyncio.gather(self._renew, return_exceptions=True)
        await super().close()
        await self.board.close()
        if self.agent is not None:
            self.agent.close()

    # ---------------------------------------------------------------- the puller's side
    async def pull_many(self, address: str, items: Sequence[_Item],
                        landed: Callable[[int, StatetierError | None], None] | None = None
                        ) -> list[StatetierError | None]:
        """A batch of one owner's objects, each EXPOSEd and READ in turn on one pooled
        connection (a request each: one multi-descriptor READ is the next step); per item, in
        order, None (landed) or its ``NotFound`` / ``Forbidden``, and once the owner is lost
        (``PeerLost``, ``Unauthorized``) that error for every item left, each told to
        ``landed(index, error)`` as soon as it is known."""
        out: list[StatetierError | None] = []
        lost: StatetierError | None = None
        for index, item in enumerate(items):
            error = lost
            if error is None:
                try:
                    await self.pull(address, item.object_id, item.tenant_tag, item.into)
                except (NotFound, Forbidden) as exc:
                    error = exc
                except (PeerLost, Unauthorized) as exc:
                    error = lost = exc
            out.append(error)
            if landed is not None:
                landed(index, error)
        return out

    async def _exchange(self, session: _PeerConnection, object_id: bytes, tenant_tag: bytes,
                        into: memoryview) -> None:
        loop = asyncio.get_running_loop()
        key, seq = session.key, session.seq
        session.seq += 2
        await loop.sock_sendall(session.sock, wire.pack_pull(key, wire.EXPOSE, bytes(16), 0, seq + 1)
                                + wire.pack_pull(key, object_id, tenant_tag, len(into), seq + 2))
        fabric, _ = await _answer(session.sock)
        if fabric not in (wire.FABRIC, wire.NOT_HERE):
            raise PeerLost(f"the peer answered a NIXL request with status {fabric}")
        status, length = await _answer(session.sock)
        if status == wire.EXPOSED and fabric == wire.FABRIC:
            address, name = await _exposed_at(session.sock)
            if length != len(into):
                raise PeerLost(f"the peer exposed {length} bytes of {object_id.hex()} for {len(into)}")
            await self._read(name, address, into)
            session.seq += 1
            await loop.sock_sendall(session.sock, wire.pack_pull(key, wire.DONE, bytes(16), 0, session.seq))
            self.exposed += 1
            return
        _check(status, length, object_id, into)
        await recv_exact(session.sock, into)
        if fabric == wire.FABRIC:
            self.inline += 1
        else:
            self.tcp_owner += 1

    async def _read(self, name: str, address: int, into: memoryview) -> None:
        agent = self.agent
        if agent is None:
            raise PeerLost("the NIXL transport is not started")
        await self._add_remote(agent, name)
        with exported_for_write(into) as (local, length):
            region = None
            if not agent.covers(local, length):
                region = agent.register(local, length)
                self.registered_per_pull += 1
            try:
                await self._transfer(agent, local, length, address, name)
            finally:
                if region is not None:
                    agent.deregister(region)

    async def _transfer(self, agent: NixlAgent, local: int, length: int, address: int, name: str) -> None:
        try:
            handle = agent.read(local, length, address, name)
        except Exception as exc:
            self._forget_remote(agent, name)
            raise PeerLost(f"NIXL could not start the read from {name}: {exc}") from exc
        try:
            spins = 0
            while (state := agent.state(handle)) == "PROC":
                spins += 1
                await asyncio.sleep(0 if spins < 64 else 0.0002)
        finally:
            agent.release(handle)
        if state != "DONE":
            self._forget_remote(agent, name)
            raise PeerLost(f"the NIXL read from {name} failed ({state}): the owner is gone or unreachable")

    async def _add_remote(self, agent: NixlAgent, name: str) -> None:
        if name in self._remotes:
            return
        blob = await self.board.fetch(name)
        if blob is None:
            raise PeerLost(f"no NIXL metadata of {name} in the directory (expired, or the owner is gone)")
        try:
            metadata = nixlmeta.verify(self._nixl_keyring, name, blob)
        except Unauthorized:
            self.metadata_refused += 1
            raise
        added = agent.add_remote(metadata)
        if added != name:
            agent.forget_remote(added)
            raise Unauthorized(f"peer: the NIXL metadata published for {name} is agent {added}'s")
        self._remotes.add(name)

    def _forget_remote(self, agent: NixlAgent, name: str) -> None:
        if name in self._remotes:
            self._remotes.discard(name)
            agent.forget_remote(name)

    def stats(self) -> dict[str, int]:
        return {"nixl_exposed": self.exposed, "nixl_inline": self.inline, "nixl_tcp_owner": self.tcp_owner,
                "nixl_registered_per_pull": self.registered_per_pull, "nixl_metadata_refused": self.metadata_refused}


async def _answer(sock: socket.socket) -> tuple[int, int]:
    head = bytearray(wire.ANSWER.size)
    await recv_exact(sock, memoryview(head))
    status, length = wire.ANSWER.unpack(head)
    return int(status), int(length)


async def _exposed_at(sock: socket.socket) -> tuple[int, str]:
    at = bytearray(wire.EXPOSED_AT.size)
    await recv_exact(sock, memoryview(at))
    address, n = wire.EXPOSED_AT.unpack(at)
    name = bytearray(n)
    await recv_exact(sock, memoryview(name))
    return int(address), name.decode(errors="replace")


def _check(status: int, length: int, object_id: bytes, into: memoryview) -> None:
    if status == wire.NOT_HERE:
        raise NotFound(f"the peer no longer holds {object_id.hex()}")
    if status == wire.FORBIDDEN:
        raise Forbidden(f"the peer refused {object_id.hex()} to this tenant")
    if status != wire.OK or length != len(into):
        raise PeerLost(f"the peer answered the pull of {object_id.hex()} with status {status}, "
                       f"{length} bytes for {len(into)}")


class NixlFabric:
    """The owner's side of EXPOSE: see the module docstring."""

    def __init__(self, agent: NixlAgent, options: PeerTierOptions) -> None:
        self.agent = agent
        self._options = options
        self.exposed = 0
        self.inline = 0

    async def expose(self, server: PeerServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     session: bytes, seq: int) -> int:
        """Answer the EXPOSE whose head was ``seq``; the last ``seq`` it read. The object is
        leased, read and checked as every pull's (``PeerServer.serving``)."""
        writer.write(wire.ANSWER.pack(wire.FABRIC, 0))
        seq += 1
        object_id, tenant_tag, _ = wire.unpack_pull(session, await reader.readexactly(wire.PULL_BYTES), seq)
        async with server.serving(writer, object_id, tenant_tag) as data:
            if data is None:
                return seq
            with exported(data) as (address, length):
                in_arena = self.agent.covers(address, length)
            if in_arena:
                seq = await self._expose(reader, writer, session, seq, address, length)
            else:
                writer.write(wire.ANSWER.pack(wire.OK, len(data)))
                writer.write(data)
                await writer.drain()  # the lease holds the bytes until they are written
                self.inline += 1
        return seq

    async def _expose(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: bytes, seq: int,
                      address: int, length: int) -> int:
        """The object's place, then the lease held until the puller's DONE (or past the pull's deadline)."""
        name = self.agent.name.encode()
        writer.write(wire.ANSWER.pack(wire.EXPOSED, length) + wire.EXPOSED_AT.pack(address, len(name)) + name)
        await writer.drain()
        async with asyncio.timeout(self._options.pull_timeout):
            frame = await reader.readexactly(wire.PULL_BYTES)
        seq += 1
        done, _, _ = wire.unpack_pull(session, frame, seq)
        if done != wire.DONE:
            raise Unauthorized("peer: a NIXL read not followed by its DONE")
        self.exposed += 1
        return seq


__all__ = ["NixlTransport", "NixlFabric", "make_transport"]
