"""The peer tier through the faults of a network between live daemons (issue 40, item 4).

Two daemons' worth of tiers in one process, a real Redis, real sockets, and the owner's
listener behind ``launch.tcp_proxy.DelayProxy`` (its ``advertise``) where the network
fails: connections dropped → the pooled connection is redialled, the pull lands; a stall
past the deadline → ``PeerLost`` within it, the live owner only suspected, the next pull
lands; the owner's address now answered by another process → that owner fenced
(``fenced_replaced``); an owner stopped renewing its liveness key → fenced (``fenced_gone``),
then offered again once it renews (``unfenced``); Redis restarted empty → the owner
publishes its entries again (``reannounced``). The handshake still answers a puller of
the first release (no owner id asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from statetier.launch import free_port
from statetier.launch.tcp_proxy import DelayProxy
from statetier.protocol.errors import NotFound, PeerLost
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.peer import PeerTier, PeerTierOptions, wire
from tests.support.tier_contract import KEYRING, make_object, store
from tests.support.waiting import eventually

MIB = 1 << 20


@contextlib.asynccontextmanager
async def daemon_tiers(url: str, name: str, *, port: int = 0, advertise: str = "", timeout: float = 1.0,
                       liveness: float = 0.6):
    async with HostTier(HostTierOptions(8 * MIB, pin_memory=False)) as host:
        peer = PeerTier(PeerTierOptions(url, owner_id=f"{name}/{os.urandom(2).hex()}", listen_port=port,
                                        advertise=advertise, pull_timeout=timeout, liveness_ttl=liveness),
                        keyring=KEYRING, local_tiers=[host], holds_locally=host.contains)
        await peer.start()
        try:
            yield host, peer
        finally:
            await peer.close()


async def published(host: HostTier, peer: PeerTier):
    meta, blob = make_object(128 * 1024)
    await store(host, meta, blob)
    await store(peer, meta, blob)
    return meta, blob


async def pull(puller: PeerTier, object_id: bytes) -> bytes:
    lease = await puller.prepare_load(object_id)
    try:
        return bytes(await puller.read(lease, into=memoryview(bytearray(lease.meta.size))))
    finally:
        await puller.complete_load(lease)


def alive_value(redis_server, peer: PeerTier) -> bytes | None:
    with contextlib.closing(redis_server.client()) as client:
        return client.get(f"st:peer:alive:{peer.options.owner_id}")


@contextlib.asynccontextmanager
async def owner_behind_proxy(url: str):
    port = free_port()
    with DelayProxy(port) as proxy:
        async with daemon_tiers(url, "owner", port=port, advertise=f"127.0.0.1:{proxy.port}") as (host, owner):
            yield proxy, host, owner


async def test_dropped_connections_are_redialled_and_the_next_pull_lands(fresh_redis):
    async with owner_behind_proxy(fresh_redis.url) as (proxy, host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        first, second = await published(host, owner), await published(host, owner)
        assert await pull(puller, first[0].object_id) == first[1]
        proxy.drop()  # the pooled connection is now closed at both ends
        assert await pull(puller, second[0].object_id) == second[1]
        faults = puller.faults.snapshot()
        assert (faults["redialled"], faults["retried"], puller.stats().extra["owners_fenced"]) == (1, 0, 0)
        assert proxy.dropped == 1 and proxy.connections == 2 and owner.server.served == 2


async def test_a_stall_past_the_deadline_is_a_miss_and_the_live_owner_is_only_suspected(fresh_redis):
    async with owner_behind_proxy(fresh_redis.url) as (proxy, host, owner), \
            daemon_tiers(fresh_redis.url, "puller", timeout=0.5) as (_, puller):
        meta, blob = await published(host, owner)
        proxy.hold()
        with pytest.raises(PeerLost, match="within 0.5 s"):
            await pull(puller, meta.object_id)
        proxy.release()
        assert puller.faults["suspected"] == 1 and puller.stats().extra["owners_fenced"] == 0
        assert await puller.contains(meta.object_id)  # still offered
        assert await pull(puller, meta.object_id) == blob  # the stalled connection was closed: a fresh one


async def test_another_owner_answering_at_the_address_fences_the_one_that_left(fresh_redis):
    port = free_port()
    async with daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        async with daemon_tiers(fresh_redis.url, "first", port=port) as (host, first):
            one, two = await published(host, first), await published(host, first)
            assert await pull(puller, one[0].object_id) == one[1]
        async with daemon_tiers(fresh_redis.url, "second", port=port) as (_, second):
            with pytest.raises(NotFound):  # the new process holds none of the old one's objects
                await pull(puller, two[0].object_id)
            assert puller.transport.answered_by(f"127.0.0.1:{port}") == second.options.owner_id
            assert puller.faults["fenced_replaced"] == 1 and puller.fences.is_fenced(first.options.owner_id)
            assert not await puller.contains(one[0].object_id)


async def test_an_owner_whose_liveness_key_expired_is_fenced_and_offered_again_once_it_renews(fresh_redis):
    async with owner_behind_proxy(fresh_redis.url) as (proxy, host, owner), \
            daemon_tiers(fresh_redis.url, "puller", timeout=0.3) as (_, puller):
        meta, blob = await published(host, owner)
        await owner.liveness.close()  # as a process frozen: no renewal, its key expires
        assert alive_value(fresh_redis, owner) is None  # as if expired (a stopped daemon drops it at once)
        proxy.hold()
        with pytest.raises(PeerLost):
            await pull(puller, meta.object_id)
        assert puller.faults["fenced_gone"] == 1 and not await puller.contains(meta.object_id)
        proxy.release()
        await owner.liveness.start()  # it runs again: the key is back
        await eventually(lambda: puller.faults["unfenced"] == 1, "the fence lifted", timeout=5)
        assert await pull(puller, meta.object_id) == blob


async def test_an_owner_publishes_its_entries_again_when_redis_restarts_empty(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (host, owner), \
            daemon_tiers(fresh_redis.url, "puller") as (_, puller):
        kept, deleted = await published(host, owner), await published(host, owner)
        await host.delete(deleted[0].object_id)  # no longer held here: not announced again
        fresh_redis.restart()  # no persistence: it comes back empty (the loop waits: nothing announced yet)
        with contextlib.closing(fresh_redis.client()) as client:
            assert client.dbsize() == 0
        await eventually(lambda: owner.faults["reannounced"] == 1, "the owner announced its entries again",
                         timeout=10)
        assert (await puller.find_by_keys([kept[0].key_digest])).metas == [[kept[0]]]
        assert await pull(puller, kept[0].object_id) == kept[1]
        assert await owner.directory.get(deleted[0].object_id) is None


async def test_an_owner_answers_a_first_release_hello_without_its_owner_id(fresh_redis):
    async with daemon_tiers(fresh_redis.url, "owner") as (_, owner):
        host, port = owner.server.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            nonce_p = os.urandom(wire.NONCE_BYTES)
            writer.write(wire.MAGIC + KEYRING.active.key_id + nonce_p)
            welcome = await reader.readexactly(wire.WELCOME_BYTES)
            key = wire.auth_key(KEYRING.active)
            assert welcome[40:] == wire.mac(key, b"owner", nonce_p, welcome[8:40])
            session = wire.session_key(key, nonce_p, welcome[8:40])
            writer.write(wire.mac(key, b"puller", nonce_p, welcome[8:40])
                         + wire.pack_pull(session, os.urandom(16), os.urandom(16), 64, 1))
            answer = await asyncio.wait_for(reader.readexactly(wire.ANSWER.size), 2)
            assert wire.ANSWER.unpack(answer) == (wire.NOT_HERE, 0)  # the session serves as before
        finally:
            writer.close()
