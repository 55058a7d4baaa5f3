"""Encrypted pulls (``peers.encrypt``, ``tiers.peer.sealing``): two daemons' worth of tiers in
one process, real sockets, real Redis, the owner behind a TCP proxy that records what it sends.

- A puller that encrypts gets the owner's bytes, a single pull and a batch, and the wire never
  carries them: a 64-byte run of each payload is nowhere in what the owner sent; without it,
  it is there. The owner seals whenever asked, whatever its own setting says (a mixed cluster).
- One flipped byte of an encrypted answer is a transfer broken off: never served, the
  connection dropped, the pull (or the batch's rest) tried again on a fresh one (``retried``),
  and it lands; the owner not taken for lost. An owner whose every answer fails to verify is
  ``PeerLost`` once the tries are spent.
- A puller that encrypts refuses an owner that answers in the clear (one that predates
  sealing): ``PeerLost``, nothing served.
- The cipher: a chunk bound to its place (nonce counter, object id), one key per direction.
- The setting: off by default, refused with the NIXL transport (which it does not cover).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from statetier.daemon.config_loading import load_config
from statetier.launch import free_port
from statetier.launch.tcp_proxy import DelayProxy
from statetier.protocol.errors import ConfigError, PeerLost
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.peer import PeerTier, PeerTierOptions, sealing, wire
from statetier.tiers.peer.directory import Descriptor
from statetier.tiers.peer.transport import RETRIES, PullItem, TcpTransport
from tests.support.peer_wire import accept_as_owner, listening, owner_in_the_clear
from tests.support.tier_contract import KEYRING, make_object, store

MIB = 1 << 20
BIG = 2 * sealing.CHUNK + 12345  # three chunks, the last one short


@contextlib.asynccontextmanager
async def peer_tiers(url: str, name: str, **options):
    async with HostTier(HostTierOptions(32 * MIB, pin_memory=False)) as host:
        peer = PeerTier(PeerTierOptions(url, owner_id=name, pull_timeout=2.0, **options), keyring=KEYRING,
                        local_tiers=[host], holds_locally=host.contains)
        await peer.start()
        try:
            yield host, peer
        finally:
            await peer.close()


@contextlib.asynccontextmanager
async def owner_behind_proxy(url: str, *, owner_encrypts: bool = False, puller_encrypts: bool = True):
    """(the owner's host tier, the owner, a puller, the proxy the owner is dialled through)."""
    port = free_port()
    with DelayProxy(port) as proxy:
        async with peer_tiers(url, "owner", listen_port=port, advertise=f"127.0.0.1:{proxy.port}",
                              encrypt=owner_encrypts) as (host, owner), \
                peer_tiers(url, "puller", encrypt=puller_encrypts) as (_, puller):
            yield host, owner, puller, proxy


async def published(host: HostTier, owner: PeerTier, payload_bytes: int):
    meta, blob = make_object(payload_bytes)
    await store(host, meta, blob)
    await store(owner, meta, blob)
    return meta, blob


async def leased_views(puller: PeerTier, metas) -> list:
    return [(await puller.prepare_load(meta.object_id), memoryview(bytearray(meta.size))) for meta in metas]


async def pull(puller: PeerTier, meta) -> bytes:
    lease = await puller.prepare_load(meta.object_id)
    into = memoryview(bytearray(meta.size))
    try:
        view = await puller.read(lease, into=into, verify=True)
    finally:
        await puller.complete_load(lease)
    assert view.obj is into.obj  # decrypted straight into the caller's buffer
    return bytes(into)


WELCOME = wire.WELCOME_BYTES + 1 + len("owner")  # what the owner sends a fresh connection first


@pytest.mark.parametrize("owner_encrypts, puller_encrypts", [(False, True), (True, False)],
                         ids=["puller-asks", "puller-does-not"])
async def test_an_encrypted_pull_lands_the_bytes_and_the_wire_never_carries_them(fresh_redis, owner_encrypts,
                                                                                puller_encrypts):
    async with owner_behind_proxy(fresh_redis.url, owner_encrypts=owner_encrypts,
                                  puller_encrypts=puller_encrypts) as (host, owner, puller, proxy):
        meta, blob = await published(host, owner, BIG)
        proxy.record()
        assert await pull(puller, meta) == blob
        recorded = proxy.recorded
        assert recorded is not None
        on_wire = sealing.sealed_length(meta.size) if puller_encrypts else meta.size
        assert len(recorded) == WELCOME + wire.ANSWER.size + on_wire  # one tag per chunk, nothing else
        for at in (meta.header_len, meta.size // 2, meta.size - 64):
            assert (blob[at : at + 64] in recorded) is not puller_encrypts
        assert owner.server.served == 1


async def test_an_encrypted_batch_lands_every_object_and_the_wire_carries_none(fresh_redis):
    async with owner_behind_proxy(fresh_redis.url) as (host, owner, puller, proxy):
        objects = [await published(host, owner, size) for size in (BIG, 64 * 1024, 0, 3 * MIB, 100)]
        proxy.record()
        pulls = await leased_views(puller, [meta for meta, _ in objects])
        told: list = []
        await puller.pull_many(pulls, lambda index, error: told.append((index, error)))
        assert told == [(index, None) for index in range(len(objects))]
        assert [bytes(view) for _, view in pulls] == [blob for _, blob in objects]
        recorded = proxy.recorded
        assert recorded is not None and owner.server.batches == 1
        assert len(recorded) == WELCOME + wire.ANSWER.size * (1 + len(objects)) + \
            sum(sealing.sealed_length(meta.size) for meta, _ in objects)
        assert not any(blob[-64:] in recorded for _, blob in objects)


async def test_a_flipped_byte_of_an_encrypted_pull_is_refused_and_the_pull_tried_again_lands(fresh_redis):
    async with owner_behind_proxy(fresh_redis.url) as (host, owner, puller, proxy):
        meta, blob = await published(host, owner, BIG)
        assert await pull(puller, meta) == blob  # the connection now pooled: the next answer comes first
        proxy.flip_next(wire.ANSWER.size + sealing.CHUNK + 100)  # in the second chunk's ciphertext
        assert await pull(puller, meta) == blob
        assert proxy.flipped == 1 and proxy.connections == 2  # the damaged connection dropped
        extra = puller.stats().extra
        assert (extra["faults"]["retried"], extra["faults"]["redialled"]) == (1, 0)
        assert extra["pulls_lost"] == 0 and extra["owners_fenced"] == 0


async def test_a_flipped_byte_in_an_encrypted_batch_pulls_the_rest_again(fresh_redis):
    async with owner_behind_proxy(fresh_redis.url) as (host, owner, puller, proxy):
        objects = [await published(host, owner, size) for size in (256 * 1024, BIG, BIG)]
        assert await pull(puller, objects[0][0]) == objects[0][1]  # pooled
        transport = puller.transport
        assert isinstance(transport, TcpTransport)
        second = objects[1][0]
        proxy.flip_next(3 * wire.ANSWER.size + sealing.sealed_length(objects[0][0].size)
                        + sealing.sealed_length(second.size) - 3)  # the second one's last tag
        items = [PullItem(meta.object_id, meta.namespace[-16:], memoryview(bytearray(meta.size)))
                 for meta, _ in objects]
        told: list = []
        out = await transport.pull_many(owner.server.address, items, lambda index, error: told.append(index))
        assert out == [None, None, None] and told == [0, 1, 2]  # the first landed once, the rest after the retry
        assert [bytes(item.into) for item in items] == [blob for _, blob in objects]
        assert proxy.flipped == 1 and proxy.connections == 2 and owner.server.batches == 2
        assert (transport.faults["retried"], transport.faults["redialled"]) == (1, 0)


@contextlib.asynccontextmanager
async def owner_sealing_garbage():
    """An owner of the cluster whose every sealed answer fails to verify (a wire that alters
    every transfer, an attacker in the path)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = await accept_as_owner(reader, writer, "altered")
        _, _, size = wire.unpack_pull(session, await reader.readexactly(wire.PULL_BYTES), 1)
        length = wire.asked(size)[0]
        writer.write(wire.ANSWER.pack(wire.OK_SEALED, length) + os.urandom(sealing.sealed_length(length)))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            await reader.read()
        writer.close()

    async with listening(serve) as address:
        yield address


async def test_an_owner_whose_every_encrypted_answer_fails_to_verify_is_peer_lost(fresh_redis):
    meta, blob = make_object(64 * 1024)
    async with owner_sealing_garbage() as address, \
            peer_tiers(fresh_redis.url, "puller", encrypt=True) as (_, puller):
        transport = puller.transport
        into = memoryview(bytearray(meta.size))
        with pytest.raises(PeerLost, match="altered on the wire"):
            await transport.pull(address, meta.object_id, meta.namespace[-16:], into)
        assert transport.faults["retried"] == RETRIES - 1 and transport.pulls == 0


async def test_a_puller_that_encrypts_refuses_an_owner_that_answers_in_the_clear(fresh_redis):
    objects = [make_object(32 * 1024) for _ in range(2)]
    async with owner_in_the_clear({meta.object_id: blob for meta, blob in objects}) as address, \
            peer_tiers(fresh_redis.url, "puller", encrypt=True) as (_, puller):
        for meta, blob in objects:
            await puller.directory.publish(Descriptor("old", address, meta, blob[: meta.header_len]))
        with pytest.raises(PeerLost, match="in the clear"):
            await pull(puller, objects[0][0])
        transport = puller.transport  # the owner, renewing no liveness key, is fenced in the tier now
        items = [PullItem(meta.object_id, meta.namespace[-16:], memoryview(bytearray(meta.size)))
                 for meta, _ in objects]
        out = await transport.pull_many(address, items)
        assert [type(error) for error in out] == [PeerLost, PeerLost]
        assert transport.pulls == 0 and transport.bytes_pulled == 0  # nothing taken


def test_a_chunk_is_bound_to_its_place_and_its_direction() -> None:
    session = os.urandom(32)
    owner, puller = sealing.Channel(session), sealing.Channel(session)
    aad = sealing.associated(b"o" * 16, 2 * 1000)
    plain = [os.urandom(1000), os.urandom(1000)]
    sealed = [memoryview(bytearray(1000 + sealing.TAG)) for _ in plain]
    for chunk, out in zip(plain, sealed):
        owner.seal(aad, memoryview(chunk), out)
    into = memoryview(bytearray(1000))
    with pytest.raises(sealing.Altered):
        puller.open(aad, sealed[1], into)  # out of place: the first nonce
    puller = sealing.Channel(session)
    for chunk, out in zip(plain, sealed):
        puller.open(aad, out, into)
        assert bytes(into) == chunk
    with pytest.raises(sealing.Altered):
        sealing.Channel(session).open(sealing.associated(b"x" * 16, 2000), sealed[0], into)  # another object
    assert sealing.seal_key(session) != sealing.seal_key(session, b"statetier/peer-seal/1 puller-to-owner")
    assert list(sealing.chunks(2 * sealing.CHUNK + 1)) == [(0, sealing.CHUNK), (sealing.CHUNK, 2 * sealing.CHUNK),
                                                          (2 * sealing.CHUNK, 2 * sealing.CHUNK + 1)]
    assert sealing.sealed_length(0) == 0 and sealing.sealed_length(sealing.CHUNK) == sealing.CHUNK + sealing.TAG


def test_encryption_is_off_by_default_and_refused_with_nixl() -> None:
    assert load_config(None, env={}).peers.encrypt is False
    assert load_config(None, env={}, overrides={"peers.encrypt": "true"}).peers.encrypt is True
    with pytest.raises(ConfigError, match="tcp"):
        load_config(None, env={}, overrides={"peers.encrypt": "true", "peers.transport": "nixl"})
