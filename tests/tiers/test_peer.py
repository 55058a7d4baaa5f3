"""The peer tier between two daemons' worth of tiers in one process: real sockets, real Redis.

An owner (a ``PeerTier`` over a real ``HostTier``) publishes; a puller finds the object
through the directory in one round trip for any number of keys and pulls it straight into
the buffer it gives. What the owner refuses: another tenant's object (``Forbidden``), a
daemon without the cluster's keyring (``Unauthorized`` at the handshake). What the puller
never serves: a torn transfer (the owner closes mid-body, on every try) or a hung one (past
the pull's deadline): both ``PeerLost``; an owner that renews no liveness key is fenced here,
and its entry stays in the directory (only its owner withdraws it).
(Redials, retries, suspicion and fences of live owners: ``test_peer_liveness``.)

A batch from one owner (``pull_many``) is one request, its objects streamed back to back and
each told as it lands; each object answered apart (not held, another tenant's); an owner
that predates batches is pulled from one object at a time; a stream torn or hung loses the
objects not landed yet (``PeerLost``); a pooled connection the owner closed is dialled again
once, the owner not taken for lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os

import pytest

from statetier.protocol.errors import ConfigError, Forbidden, NotFound, PeerLost, Unauthorized
from statetier.protocol.keyring import Keyring, SigAlg
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.peer import PeerTier, PeerTierOptions
from statetier.tiers.peer import wire
from statetier.tiers.peer.directory import Descriptor
from statetier.tiers.peer.transport import RETRIES, PullItem, TcpTransport
from tests.support.peer_wire import accept_as_owner, listening, owner_in_the_clear
from tests.support.tier_contract import KEYRING, make_object, store

MIB = 1 << 20


@contextlib.asynccontextmanager
async def daemon_tiers(url: str, name: str, keyring: Keyring = KEYRING, timeout: float = 2.0):
    """A host tier and the peer tier beside it, as a daemon's composition root wires them."""
    async with HostTier(HostTierOptions(8 * MIB, pin_memory=False)) as host:
        peer = PeerTier(PeerTierOptions(url, owner_id=name, pull_timeout=timeout), keyring=keyring,
                        local_tiers=[host], holds_locally=host.contains)
        await peer.start()
        try:
            yield host, peer
        finally:
            await peer.close()


async def published(host: HostTier, peer: PeerTier, payload_bytes: int = 256 * 1024):
    meta, blob = make_object(payload_bytes)
    await store(host, meta, blob)
    await store(peer, meta, blob)  # the publish: its descriptor into the directory
    return meta, blob


async def test_a_pull_lands_the_owners_bytes_in_the_buffer_the_puller_gives(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        meta, blob = await published(host, owner)
        assert owner.directory.round_trips == 1 and owner.stats().extra["published"] == 1
        (found,) = (await puller.find_by_keys([meta.key_digest])).metas
        assert found == [meta]
        lease = await puller.prepare_load(meta.object_id)
        into = memoryview(bytearray(meta.size))
        try:
            view = await puller.read(lease, into=into, verify=True)
        finally:
            await puller.complete_load(lease)
        assert view.obj is into.obj and bytes(into) == blob  # straight into the caller's buffer
        assert owner.server.served == 1 and owner.server.bytes_served == meta.size
        assert (await owner.find_by_keys([meta.key_digest])).metas == [[]]  # its own entry is not a peer's


async def test_a_lookup_of_many_keys_is_one_directory_round_trip(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        metas = [(await published(host, owner, 4096))[0] for _ in range(32)]
        before = puller.directory.round_trips
        matches = await puller.find_by_keys([m.key_digest for m in metas])
        assert puller.directory.round_trips - before == 1
        assert matches.metas == [[m] for m in metas]


async def test_the_owner_refuses_another_tenants_object(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner):
        meta, _ = await published(host, owner)
        transport = TcpTransport(KEYRING, owner.options)
        try:
            with pytest.raises(Forbidden):
                await transport.pull(owner.server.address, meta.object_id, os.urandom(16),
                                     memoryview(bytearray(meta.size)))
        finally:
            await transport.close()
        assert owner.server.refused == 1 and owner.server.served == 0


async def test_a_daemon_without_the_clusters_keyring_is_refused_at_the_handshake(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner):
        meta, _ = await published(host, owner)
        transport = TcpTransport(Keyring.generate(), owner.options)
        try:
            with pytest.raises(Unauthorized):
                await transport.pull(owner.server.address, meta.object_id, meta.namespace[-16:],
                                     memoryview(bytearray(meta.size)))
        finally:
            await transport.close()
        assert owner.server.served == 0


@contextlib.asynccontextmanager
async def broken_owner(blob: bytes, *, hang: bool):
    """An owner that authenticates as a daemon of the cluster, then sends half the object and
    closes the connection (``hang=False``) or stops sending (``hang=True``)."""
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accept_as_owner(reader, writer, "gone")
        await reader.readexactly(wire.PULL_BYTES)
        writer.write(wire.ANSWER.pack(wire.OK, len(blob)) + blob[: len(blob) // 2])
        await writer.drain()
        if hang:
            await release.wait()
        writer.close()

    async with listening(serve, release) as address:
        yield address


@pytest.mark.parametrize("hang", [False, True], ids=["closed-mid-body", "hung-mid-body"])
async def test_a_torn_transfer_is_peer_lost_never_served_and_an_owner_without_liveness_is_fenced(fresh_redis, hang):
    meta, blob = make_object(1 * MIB)
    async with broken_owner(blob, hang=hang) as address, \
            daemon_tiers(fresh_redis.url, "puller", timeout=0.5) as (_, puller):
        await puller.directory.publish(Descriptor("gone", address, meta, blob[: meta.header_len]))
        assert await puller.contains(meta.object_id)
        lease = await puller.prepare_load(meta.object_id)
        into = memoryview(bytearray(meta.size))
        try:
            with pytest.raises(PeerLost):
                await puller.read(lease, into=into)
        finally:
            await puller.complete_load(lease)
        assert not await puller.contains(meta.object_id)  # fenced here: no lookup offers it again
        assert await puller.directory.get(meta.object_id) is not None  # a puller withdraws nothing
        extra = puller.stats().extra
        assert extra["pulls_lost"] == 1 and extra["owners_fenced"] == 1 and extra["faults"]["fenced_gone"] == 1
        # closed mid-body: broken off on every fresh connection, tried again in all; hung: the deadline ends it
        assert extra["faults"]["retried"] == (0 if hang else RETRIES - 1)


async def test_an_ed25519_keyring_cannot_start_a_peer_tier(fresh_redis):
    async with HostTier(HostTierOptions(1 * MIB, pin_memory=False)) as host:
        peer = PeerTier(PeerTierOptions(fresh_redis.url, owner_id="signer"), keyring=Keyring.generate(SigAlg.ED25519),
                        local_tiers=[host], holds_locally=host.contains)
        with pytest.raises(ConfigError, match="HMAC"):
            await peer.start()
        await peer.close()


# ---------------------------------------------------------------- a batch from one owner (issue 40)

async def leased_views(puller: PeerTier, metas) -> list:
    return [(await puller.prepare_load(meta.object_id), memoryview(bytearray(meta.size))) for meta in metas]


async def test_a_batch_from_one_owner_is_one_request_streamed_back_to_back(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        objects = [await published(host, owner, 64 * 1024) for _ in range(12)]
        pulls = await leased_views(puller, [meta for meta, _ in objects])
        told: list = []
        await puller.pull_many(pulls, lambda index, error: told.append((index, error)))
        assert told == [(index, None) for index in range(12)]  # each told as it landed, in order
        assert [bytes(view) for _, view in pulls] == [blob for _, blob in objects]
        transport = puller.transport
        assert isinstance(transport, TcpTransport)
        assert owner.server.batches == 1 and owner.server.served == 12  # one request for all twelve
        assert transport.batches == 1 and transport.pulls == 12
        await puller.pull_many(await leased_views(puller, [objects[0][0]]), lambda index, error: None)
        assert owner.server.batches == 2 and transport.batches == 2  # the pooled connection, reused


async def test_a_batch_answers_each_object_apart(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        (kept, blob), (gone, _) = await published(host, owner), await published(host, owner)
        pulls = await leased_views(puller, [gone, kept])
        await host.delete(gone.object_id)  # still described, no longer held
        transport = puller.transport
        assert isinstance(transport, TcpTransport)
        items = [PullItem(meta.object_id, meta.namespace[-16:], view) for meta, (_, view) in zip((gone, kept), pulls)]
        items.append(PullItem(kept.object_id, os.urandom(16), memoryview(bytearray(kept.size))))  # another tenant
        out = await transport.pull_many(owner.server.address, items)
        assert [type(error) for error in out] == [NotFound, type(None), Forbidden]
        assert bytes(pulls[1][1]) == blob and owner.server.batches == 1 and owner.server.refused == 1


async def test_an_owner_that_predates_batches_is_pulled_from_one_object_at_a_time(fresh_redis):
    objects = [make_object(32 * 1024) for _ in range(3)]
    async with owner_in_the_clear({meta.object_id: blob for meta, blob in objects}) as address, \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        for meta, blob in objects:
            await puller.directory.publish(Descriptor("old", address, meta, blob[: meta.header_len]))
        pulls = await leased_views(puller, [meta for meta, _ in objects])
        told: list = []
        await puller.pull_many(pulls, lambda index, error: told.append(error))
        assert told == [None] * 3 and [bytes(view) for _, view in pulls] == [blob for _, blob in objects]
        assert puller.stats().extra["pulls_lost"] == 0  # not taken for lost
        transport = puller.transport
        assert isinstance(transport, TcpTransport) and transport.batches == 0 and transport.pulls == 3


@contextlib.asynccontextmanager
async def owner_torn_mid_batch(blob: bytes, *, hang: bool):
    """An owner of the cluster that answers a PULL_MANY with its first object whole, half of
    the second, then closes the connection (``hang=False``) or stops sending (``hang=True``);
    every later connection (the puller's retries) is torn in its first object."""
    release = asyncio.Event()
    connections = itertools.count()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = await accept_as_owner(reader, writer, "gone")
        _, _, count = wire.unpack_pull(session, await reader.readexactly(wire.PULL_BYTES), 1)
        await reader.readexactly(wire.many_bytes(count))
        head = wire.ANSWER.pack(wire.OK, len(blob))
        whole = head + blob if next(connections) == 0 else b""
        writer.write(wire.ANSWER.pack(wire.BATCH, count) + whole + head + blob[: len(blob) // 2])
        await writer.drain()
        if hang:
            await release.wait()
        writer.close()

    async with listening(serve, release) as address:
        yield address


@pytest.mark.parametrize("hang", [False, True], ids=["closed-mid-body", "hung-mid-body"])
async def test_a_batch_torn_mid_stream_loses_the_rest_and_fences_the_owner(fresh_redis, hang):
    meta, blob = make_object(1 * MIB)
    async with owner_torn_mid_batch(blob, hang=hang) as address, \
            daemon_tiers(fresh_redis.url, "puller", timeout=0.5) as (_, puller):
        await puller.directory.publish(Descriptor("gone", address, meta, blob[: meta.header_len]))
        pulls = await leased_views(puller, [meta, meta, meta])
        told: list = []
        await puller.pull_many(pulls, lambda index, error: told.append(error))
        assert [type(error) for error in told] == [type(None), PeerLost, PeerLost]  # the first landed whole
        assert bytes(pulls[0][1]) == blob
        transport = puller.transport
        assert isinstance(transport, TcpTransport)  # a torn stream is pulled again; a hung one is not
        assert transport.faults.snapshot()["retried"] == (0 if hang else RETRIES - 1)
        assert not await puller.contains(meta.object_id) and puller.stats().extra["pulls_lost"] == 1


async def test_a_pooled_connection_the_owner_closed_is_dialled_again_for_a_batch(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        objects = [await published(host, owner, 4096) for _ in range(3)]
        await puller.pull_many(await leased_views(puller, [objects[0][0]]), lambda index, error: None)
        for task in list(owner.server._connections):  # the owner drops its side (an idle timeout, a restart)
            task.cancel()
        await asyncio.sleep(0)
        told: list = []
        pulls = await leased_views(puller, [meta for meta, _ in objects])
        await puller.pull_many(pulls, lambda index, error: told.append(error))
        assert told == [None] * 3 and [bytes(view) for _, view in pulls] == [blob for _, blob in objects]
        assert puller.stats().extra["pulls_lost"] == 0 and owner.server.batches == 2
