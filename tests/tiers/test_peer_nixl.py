"""The NIXL transport between two daemons' worth of tiers in one process (``make test-nixl``).

Skipped unless ``nixl_cu12`` imports (the ``nixl`` extra); run with ``UCX_TLS=tcp`` where no
fabric is. Real NIXL agents over UCX, real sockets, real Redis: the owner's bytes read by the
puller from the owner's registered arena straight into the buffer it gives (registered for the
pull when outside its own arena), verified there. What is never served: a flipped byte in the
owner's memory (``CorruptPayload``), a pull through forged agent metadata (``Unauthorized``,
nothing added to NIXL), an owner gone (``PeerLost``), a READ that fails while the owner's
listener answers (``PeerLost``; the agent's metadata fetched again next time). An object
outside the owner's registered memory comes back inline; an owner without NIXL is pulled from
over TCP; a batch from one owner is read object by object, each told as it lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass

import pytest
import redis

from statetier.protocol.errors import CorruptPayload, NotFound, PeerLost, Unauthorized
from statetier.protocol.keyring import Keyring
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.peer import PeerTier, PeerTierOptions
from statetier.tiers.peer import nixl, nixlmeta
from statetier.tiers.memory.rawmemory import exported
from statetier.tiers.peer.nixl import NixlTransport
from statetier.tiers.peer.nixlagent import NixlAgent
from tests.support.tier_contract import KEYRING, make_object, store

pytest.importorskip("nixl_cu12._api")

MIB = 1 << 20


@contextlib.asynccontextmanager
async def daemon_tiers(url: str, name: str, *, nixl: bool = True, arena: bool = True, timeout: float = 3.0):
    """A host tier and the peer tier beside it, as the composition root wires them with
    ``peers.transport = "nixl"`` (``arena=False``: nothing registered at start)."""
    async with HostTier(HostTierOptions(8 * MIB, pin_memory=False)) as host:
        options = PeerTierOptions(url, owner_id=name, pull_timeout=timeout)
        transport = NixlTransport(KEYRING, options, host if arena else None) if nixl else None
        peer = PeerTier(options, keyring=KEYRING, local_tiers=[host], holds_locally=host.contains,
                        transport=transport)
        await peer.start()
        try:
            yield host, peer
        finally:
            await peer.close()


async def published(host: HostTier, peer: PeerTier, payload_bytes: int = 256 * 1024):
    meta, blob = make_object(payload_bytes)
    await store(host, meta, blob)
    await store(peer, meta, blob)
    return meta, blob


async def pull(puller: PeerTier, meta, into: memoryview | None = None) -> memoryview:
    lease = await puller.prepare_load(meta.object_id)
    try:
        return await puller.read(lease, into=into if into is not None else memoryview(bytearray(meta.size)))
    finally:
        await puller.complete_load(lease)


async def settled(check, seconds: float = 2.0) -> bool:
    """The owner counts a NIXL pull when its DONE arrives, after the puller has returned."""
    for _ in range(int(seconds / 0.01)):
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


def transport(peer: PeerTier) -> NixlTransport:
    assert isinstance(peer.transport, NixlTransport)
    return peer.transport


async def test_the_owners_bytes_are_read_with_nixl_into_the_buffer_the_puller_gives(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (puller_host, puller):
        meta, blob = await published(host, owner)
        into = memoryview(bytearray(meta.size))  # outside the puller's arena: registered for this pull
        view = await pull(puller, meta, into)
        assert view.obj is into.obj and bytes(into) == blob
        assert transport(puller).stats() == {"nixl_exposed": 1, "nixl_inline": 0, "nixl_tcp_owner": 0,
                                              "nixl_registered_per_pull": 1, "nixl_metadata_refused": 0}
        fabric = owner.server.fabric
        assert fabric is not None and await settled(lambda: fabric.exposed == 1)
        assert owner.server.served == 1 and owner.server.bytes_served == meta.size
        arena = puller_host.arena_view[MIB: MIB + meta.size]  # a promotion's place: registered at start
        await pull(puller, meta, arena)
        assert bytes(arena) == blob and transport(puller).registered_per_pull == 1
        assert await settled(lambda: fabric.exposed == 2) and puller.stats().extra["nixl_exposed"] == 2
        assert host.stats().leases == 0  # the owner's leases released at DONE


async def test_a_flipped_byte_in_the_owners_memory_is_refused_where_it_lands(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        meta, blob = await published(host, owner)
        arena = host.arena_view
        at = bytes(arena).find(blob)
        assert at >= 0
        arena[at + len(blob) - 7] ^= 0x01  # in the payload, under the signed digest
        with pytest.raises(CorruptPayload):
            await pull(puller, meta)
        assert transport(puller).exposed == 1  # read with NIXL, refused by open_sealed


async def test_forged_agent_metadata_is_refused_before_nixl_sees_it(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        meta, _ = await published(host, owner)
        key = nixlmeta.board_key("owner")
        with contextlib.closing(redis.Redis.from_url(fresh_redis.url)) as r:
            genuine = r.get(key)
            assert genuine is not None
            forged = bytearray(genuine)
            forged[-1] ^= 0x01  # the metadata, not its MAC
            r.set(key, bytes(forged))
            with pytest.raises(Unauthorized):
                await pull(puller, meta)
            other = nixlmeta.sign(Keyring.generate(), "owner", genuine[8 + 1 + len(b"owner") + 32:])
            r.set(key, other)  # signed, but by another cluster's keyring
            with pytest.raises(Unauthorized):
                await pull(puller, meta)
            assert transport(puller).metadata_refused == 2 and transport(puller).exposed == 0
            r.set(key, genuine)
        assert bytes(await pull(puller, meta)) and transport(puller).exposed == 1


async def test_an_owner_gone_is_peer_lost_and_fenced(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "puller", timeout=1.0) as (_, puller):
        async with daemon_tiers(fresh_redis.url, "owner") as (host, owner):
            meta, _ = await published(host, owner)
            await pull(puller, meta)  # the owner's agent known to the puller
            await owner.close()  # its listener and its NIXL agent gone
            with pytest.raises(PeerLost):
                await pull(puller, meta)
        assert puller.stats().extra["pulls_lost"] == 1


async def test_an_object_outside_the_owners_registered_memory_comes_back_inline(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner", arena=False) as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        meta, blob = await published(host, owner)
        assert bytes(await pull(puller, meta)) == blob
        assert transport(puller).inline == 1 and transport(puller).exposed == 0


async def test_an_owner_without_nixl_is_pulled_from_over_tcp(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner", nixl=False) as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        meta, blob = await published(host, owner)
        assert bytes(await pull(puller, meta)) == blob
        assert transport(puller).tcp_owner == 1 and owner.server.served == 1
        assert bytes(await pull(puller, meta)) == blob  # the connection stays in step


@dataclass(frozen=True)
class Item:
    object_id: bytes
    tenant_tag: bytes
    into: memoryview


async def test_a_batch_from_one_owner_is_read_with_nixl_each_told_as_it_lands(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        objects = [await published(host, owner, 64 * 1024) for _ in range(3)]
        tag = objects[0][0].namespace[-16:]
        items = [Item(m.object_id, tag, memoryview(bytearray(m.size))) for m, _ in objects]
        items.insert(1, Item(os.urandom(16), tag, memoryview(bytearray(10))))  # held by no one
        told: list[tuple[int, object]] = []
        out = await transport(puller).pull_many(owner.server.address, items, lambda i, e: told.append((i, e)))
        assert [type(e) for e in out] == [type(None), NotFound, type(None), type(None)]
        assert [i for i, _ in told] == [0, 1, 2, 3]
        assert [bytes(item.into) for item in items[:1] + items[2:]] == [blob for _, blob in objects]
        assert transport(puller).exposed == 3
        await owner.close()
        lost = await transport(puller).pull_many(owner.server.address, items[:2])
        assert all(isinstance(e, PeerLost) for e in lost)  # the owner gone: every item left lost


async def test_a_nixl_read_that_fails_is_peer_lost_and_the_agent_is_fetched_again(fresh_redis):
    """The owner's listener answers, but its NIXL agent is a new one (new UCX worker): the READ
    through the metadata the puller holds fails (PeerLost within the deadline, nothing served);
    once the new agent's metadata is published, the next pull fetches it and reads."""
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller", timeout=3.0) as (_, puller):
        meta, blob = await published(host, owner)
        await pull(puller, meta)  # the owner's first agent added at the puller
        old = transport(owner).agent
        assert old is not None and owner.server.fabric is not None
        old.close()
        del old._agent  # its UCX worker gone
        fresh = NixlAgent("owner")
        with exported(host.arena_view) as (address, length):
            fresh.register(address, length)
        transport(owner).agent = owner.server.fabric.agent = fresh
        with pytest.raises(PeerLost):
            await pull(puller, meta)
        assert puller.stats().extra["pulls_lost"] == 1
        await transport(owner).board.publish("owner", nixlmeta.sign(KEYRING, "owner", fresh.metadata()))
        into = memoryview(bytearray(meta.size))  # the transport itself (the tier has fenced this owner id)
        await transport(puller).pull(owner.server.address, meta.object_id, meta.namespace[-16:], into)
        assert bytes(into) == blob and transport(puller).exposed == 2


async def test_the_agent_metadata_is_published_again_once_the_directory_lost_it(fresh_redis, monkeypatch):
    monkeypatch.setattr(nixl, "RENEW_SECONDS", 0.05)
    async with daemon_tiers(fresh_redis.url, "owner"):
        with contextlib.closing(redis.Redis.from_url(fresh_redis.url)) as r:
            key = nixlmeta.board_key("owner")
            assert r.exists(key) and 0 < r.ttl(key) <= 3600  # the directory's TTL
            r.flushall()  # as a Redis restarted without its data
            assert await settled(lambda: r.exists(key) == 1)
