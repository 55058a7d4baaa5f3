"""The peer tier between two daemons' worth of tiers in one process: real sockets, real Redis.

An owner (a ``PeerTier`` over a real ``HostTier``) publishes; a puller finds the object
through the directory in one round trip for any number of keys and pulls it straight into
the buffer it gives. What the owner refuses: another tenant's object (``Forbidden``), a
daemon without the cluster's keyring (``Unauthorized`` at the handshake). What the puller
never serves: a torn transfer (the owner closes mid-body, on every try) or a hung one (past
the pull's deadline): both ``PeerLost``; an owner that renews no liveness key is fenced here,
and its entry stays in the directory (only its owner withdraws it).
(Redials, retries, suspicion and fences of live owners: ``test_peer_liveness``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from statetier.protocol.errors import ConfigError, Forbidden, PeerLost, Unauthorized
from statetier.protocol.keyring import Keyring, SigAlg
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.peer import PeerTier, PeerTierOptions
from statetier.tiers.peer import wire
from statetier.tiers.peer.directory import Descriptor
from statetier.tiers.peer.transport import RETRIES, TcpTransport
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
        hello = await reader.readexactly(wire.HELLO_BYTES)
        key, nonce_p, nonce_o = wire.auth_key(KEYRING.active), hello[16:], os.urandom(wire.NONCE_BYTES)
        owner = wire.owner_id_bytes("gone")
        writer.write(KEYRING.active.key_id + nonce_o + wire.owner_proof(key, nonce_p, nonce_o, owner)
                     + bytes([len(owner)]) + owner)
        await reader.readexactly(wire.MAC_BYTES + wire.PULL_BYTES)
        writer.write(wire.ANSWER.pack(wire.OK, len(blob)) + blob[: len(blob) // 2])
        await writer.drain()
        if hang:
            await release.wait()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    try:
        yield f"{host}:{port}"
    finally:
        release.set()
        server.close()


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
