"""The owner's side: this daemon's objects served to the other daemons of the cluster.

``PeerServer(keyring, options, local_tiers)`` — ``start()`` binds the TCP listener
(``address`` then says where it listens); each connection first runs the handshake of
``tiers.peer.wire`` (a daemon without this cluster's keyring is dropped; a puller that asks
is told this process's owner id), then answers
pulls one after the other: the object leased in the first local tier holding it, refused
(``FORBIDDEN``) unless its namespace is owned by the tenant the request names, sent as it
lies under the lease (``verify=False``: the puller verifies where the bytes land), the
lease released once written. A ``PULL_MANY`` is answered the same way for each of its
objects, back to back in order, each leased in turn and released once written. A pull that
asks for its answer sealed (``wire.SEALED``) is answered ``OK_SEALED``, the object encrypted
chunk by chunk (``tiers.peer.sealing``: one pass, from the leased bytes into one of two chunk
buffers the connection keeps, each sent while the next is encrypted), whatever this daemon's
own ``peers.encrypt`` says: a cluster of both kinds works.
``close()`` stops listening and drops the connections. ``quiet(at_most)`` returns once no
pull has been answered for ``QUIET_AFTER`` seconds, nor an object published (``published()``:
its pulls are likely next), or after ``at_most`` seconds: the write-behind waits on it, so
the owner's disk copies run after the pulls of what it just published.
Counted: ``served``, ``bytes_served``, ``refused``, ``handshakes_failed``, ``batches``, ``requests``; ``answering``:
the requests being answered now.
With ``fabric`` set (``tiers.peer.nixl``), an EXPOSE is answered there: the object read by the
puller with NIXL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import AsyncIterator, Protocol, Sequence

from statetier.protocol.errors import NotFound, StatetierError, Unauthorized
from statetier.protocol.identity import NAMESPACE_BYTES
from statetier.protocol.keyring import Keyring
from statetier.protocol.ownership import TAG_BYTES
from statetier.protocol.sealed import parse_header
from statetier.tiers.base import Lease, Tier

from . import sealing, wire
from .options import PeerTierOptions
from .transport import tune

log = logging.getLogger("statetier.peer")

#: How long an owner must have answered no pull (and published nothing) to count as quiet.
QUIET_AFTER = 0.1


class Fabric(Protocol):
    """Answers an EXPOSE whose head was ``seq`` (``tiers.peer.nixl.NixlFabric``): the last ``seq`` it read."""

    async def expose(self, server: "PeerServer", reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     session: bytes, seq: int) -> int: ...


class PeerServer:
    def __init__(self, keyring: Keyring, options: PeerTierOptions, local_tiers: Sequence[Tier]) -> None:
        self._keyring = keyring
        self._options = options
        self._local = list(local_tiers)
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.address = ""
        self.served = 0
        self.bytes_served = 0
        self.refused = 0
        self.handshakes_failed = 0
        self.batches = 0
        self.requests = 0  # PULL and PULL_MANY requests answered (a batch is one)
        self.answering = 0  # requests being answered now
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._quiet_timer: asyncio.TimerHandle | None = None
        self.fabric: Fabric | None = None  # set by the NIXL transport's start

    async def start(self) -> None:
        opts = self._options
        self._server = await asyncio.start_server(self._on_connection, opts.listen_host, opts.listen_port,
                                                  limit=wire.PULL_BYTES * 4)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = opts.advertise or f"{host}:{port}"

    async def close(self) -> None:
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()
            self._quiet_timer = None
        self._quiet.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            tune(sock, self._options.socket_buffer_bytes)
        # drain() returns only once the transport holds none of an object's bytes: uvloop keeps a
        # reference to what the socket has not taken, and a lease ends right after the drain
        writer.transport.set_write_buffer_limits(high=0)
        try:
            session = await self._handshake(reader, writer)
            sealer = _Sealer(session)
            seq = 0
            while True:
                frame = await reader.readexactly(wire.PULL_BYTES)
                seq += 1
                object_id, tenant_tag, size = wire.unpack_pull(session, frame, seq)
                self._begin()
                self.requests += 1
                try:
                    if object_id == wire.MANY:
                        await self._answer_many(reader, writer, session, size, seq, sealer)
                    elif object_id == wire.EXPOSE and self.fabric is not None:
                        seq = await self.fabric.expose(self, reader, writer, session, seq)
                    else:
                        await self._answer(writer, object_id, tenant_tag, size, sealer)
                finally:
                    self._end()
        except Unauthorized as exc:
            self.handshakes_failed += 1
            log.warning("peer connection refused: %s", exc.message)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, StatetierError):
            pass  # the puller went away or sent what does not parse: the connection ends
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        async with asyncio.timeout(self._options.pull_timeout):
            hello = await reader.readexactly(wire.HELLO_BYTES)
            magic = hello[: len(wire.MAGIC)]
            if magic not in (wire.MAGIC, wire.MAGIC_OWNER):
                raise Unauthorized("peer: not a statetier daemon's hello")
            owner_id = wire.owner_id_bytes(self._options.owner_id) if magic == wire.MAGIC_OWNER else None
            key_id, nonce_p = hello[len(wire.MAGIC) : len(wire.MAGIC) + 8], hello[len(wire.MAGIC) + 8 :]
            try:
                puller_key = wire.key_for(self._keyring, key_id)
            except Unauthorized:
                writer.write(wire.REFUSED)  # said, so the puller does not take this owner for lost
                await writer.drain()
                raise
            active = self._keyring.active
            own_key = wire.auth_key(active)
            nonce_o = os.urandom(wire.NONCE_BYTES)
            writer.write(active.key_id + nonce_o + wire.owner_proof(own_key, nonce_p, nonce_o, owner_id))
            if owner_id is not None:
                writer.write(bytes([len(owner_id)]) + owner_id)
            proof = await reader.readexactly(wire.MAC_BYTES)
            if wire.mac(puller_key, b"puller", nonce_p, nonce_o) != proof:
                raise Unauthorized("peer: the puller did not prove it holds this cluster's keyring")
            return wire.session_key(puller_key, nonce_p, nonce_o)

    def _begin(self) -> None:
        self.answering += 1
        self._quiet.clear()

    def _end(self) -> None:
        self.answering -= 1
        if not self.answering:
            self._quiet_later()

    def published(self) -> None:
        """An object was just published: its pulls are likely next, so not quiet yet."""
        if not self.answering:
            self._quiet.clear()
            self._quiet_later()

    def _quiet_later(self) -> None:
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()
        self._quiet_timer = asyncio.get_running_loop().call_later(QUIET_AFTER, self._maybe_quiet)

    def _maybe_quiet(self) -> None:
        self._quiet_timer = None
        if not self.answering:
            self._quiet.set()

    async def quiet(self, at_most: float) -> bool:
        """Wait until the owner is quiet (no pull answered, nothing published, for ``QUIET_AFTER``
        seconds), at most ``at_most`` seconds: True when it is."""
        if self._quiet.is_set():
            return True
        try:
            async with asyncio.timeout(at_most):
                await self._quiet.wait()
            return True
        except TimeoutError:
            return False

    async def _answer_many(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: bytes,
                           count: int, seq: int, sealer: "_Sealer") -> None:
        """A PULL_MANY: ``BATCH``, then each object's answer back to back, in order."""
        items = wire.unpack_pull_many(session, await reader.readexactly(wire.many_bytes(count)), seq)
        self.batches += 1
        writer.write(wire.ANSWER.pack(wire.BATCH, len(items)))
        for object_id, tenant_tag, size in items:
            await self._answer(writer, object_id, tenant_tag, size, sealer)
        await writer.drain()

    async def _answer(self, writer: asyncio.StreamWriter, object_id: bytes, tenant_tag: bytes, size: int,
                      sealer: "_Sealer") -> None:
        """One object's answer: in the clear, or sealed when the pull's ``size`` asks for it."""
        async with self.serving(writer, object_id, tenant_tag) as data:
            if data is None:
                return
            if wire.asked(size)[1]:
                await sealer.write(writer, object_id, data)
            else:
                writer.write(wire.ANSWER.pack(wire.OK, len(data)))
                writer.write(data)
                await writer.drain()  # the lease holds the bytes until they are written

    @contextlib.asynccontextmanager
    async def serving(self, writer: asyncio.StreamWriter, object_id: bytes,
                      tenant_tag: bytes) -> AsyncIterator[memoryview | None]:
        """The object leased in the first local tier holding it and read as it lies, for one
        answer (TCP's, or the NIXL fabric's): None when ``NOT_HERE`` or ``FORBIDDEN`` was
        answered already; counted as served once the answer's body ends without an error; the
        lease released on the way out, whatever happened."""
        found = await self._lease(object_id)
        if found is None:
            writer.write(wire.ANSWER.pack(wire.NOT_HERE, 0))
            yield None
            return
        tier, lease = found
        try:
            data = await tier.read(lease, verify=False)
            if _tenant_tag_of(lease, data) != tenant_tag:
                self.refused += 1
                writer.write(wire.ANSWER.pack(wire.FORBIDDEN, 0))
                yield None
                return
            yield data
            self.served += 1
            self.bytes_served += len(data)
        finally:
            await tier.complete_load(lease)

    async def _lease(self, object_id: bytes) -> tuple[Tier, Lease] | None:
        for tier in self._local:
            try:
                return tier, await tier.prepare_load(object_id, owner="peer", ttl=self._options.lease_ttl)
            except NotFound:
                continue
            except StatetierError as exc:
                log.debug("peer pull of %s: %s passed over: %s", object_id.hex(), tier.name, exc)
        return None


class _Sealer:
    """The sealed answers of one connection: its owner-to-puller ``sealing.Channel`` and two
    chunk buffers, made at its first sealed pull (a connection that asks for none pays nothing)."""

    def __init__(self, session: bytes) -> None:
        self._session = session
        self._channel: sealing.Channel | None = None
        self._buffers: list[memoryview] = []

    async def write(self, writer: asyncio.StreamWriter, object_id: bytes, data: memoryview) -> None:
        """``OK_SEALED`` and ``data`` sealed, chunk by chunk: each chunk encrypted while the one
        before it is sent, a buffer reused only once the transport has let go of it."""
        if self._channel is None:
            self._channel = sealing.Channel(self._session)
            self._buffers = [memoryview(bytearray(sealing.CHUNK + sealing.TAG)) for _ in range(2)]
        writer.write(wire.ANSWER.pack(wire.OK_SEALED, len(data)))
        aad = sealing.associated(object_id, len(data))
        for index, (start, end) in enumerate(sealing.chunks(len(data))):
            out = self._buffers[index % 2][: end - start + sealing.TAG]  # it held chunk index-2: taken
            self._channel.seal(aad, data[start:end], out)
            await writer.drain()  # chunk index-1 taken: its buffer free for chunk index+1
            writer.write(out)
        await writer.drain()  # every chunk taken: both buffers free for the next answer


def _tenant_tag_of(lease: Lease, data: memoryview) -> bytes:
    namespace = lease.meta.namespace
    if not namespace:
        namespace = parse_header(data[: lease.meta.header_len]).key.namespace.digest
    return bytes(namespace[NAMESPACE_BYTES - TAG_BYTES :])


__all__ = ["PeerServer"]
