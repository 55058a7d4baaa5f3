"""A decode node's lookup of a whole request costs the same Redis round trips whatever its size.

The node has only the Redis tier and the Redis version registry (what a decode node of a
PD handoff has). A request of 2 attention layers and one of 24 (each with SSM snapshots,
two TP shards and a chain of 4 boundaries) are looked up; the round trips are counted
where they leave the process: the requests written on a socket to Redis (one server) and
the tier's pipelined exchanges (a cluster, where one exchange goes to the masters in
parallel). On one server a lookup is at most 2 round trips, leases included; the loads
that follow still verify every object and get their bytes.
"""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio.connection

import statetier.tiers.redis.connect as redis_module
from statetier.daemon.engine import Engine, EngineOptions, Publishing
from statetier.daemon.requests import LoadRequest, LookupRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, prefix_hashes
from statetier.protocol.keyring import Keyring
from statetier.tiers.redis import RedisTier, RedisTierOptions, RedisVersionRegistry

NS = NamespaceSpec("decode-lookup").namespace()
SPECS = (TensorSpec("kv", "bfloat16", (4, 256)),)
CHAIN = prefix_hashes(list(range(64)), 16)
BOUNDS = tuple((16 * (i + 1), CHAIN[i]) for i in range(4))
SHARDS = (0, 1)
SSM_LAYERS = (100, 101)


class RoundTrips:
    """Counts requests written to Redis sockets, and the Redis tier's exchanges."""

    def __init__(self, monkeypatch) -> None:
        self.sends = self.exchanges = 0
        send, exchange = redis.asyncio.connection.AbstractConnection.send_packed_command, redis_module.exchange

        async def counted_send(connection, *args, **kwargs):
            self.sends += 1
            return await send(connection, *args, **kwargs)

        async def counted_exchange(*args, **kwargs):
            self.exchanges += 1
            return await exchange(*args, **kwargs)

        monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", counted_send)
        monkeypatch.setattr(redis_module, "exchange", counted_exchange)

    def reset(self) -> None:
        self.sends = self.exchanges = 0


@pytest.fixture(params=["single", "cluster"])
def redis_url(request) -> tuple[str, bool]:
    if request.param == "single":
        return request.getfixturevalue("redis_server").url, False
    return request.getfixturevalue("redis_cluster").url, True


async def _engine(url: str) -> Engine:
    keyring, prefix = Keyring.generate(), f"lk-{uuid.uuid4().hex[:12]}"
    tier = RedisTier(RedisTierOptions(url, key_prefix=prefix), keyring=keyring)
    engine = Engine([tier], keyring=keyring, registry=RedisVersionRegistry(url, key_prefix=prefix),
                    options=EngineOptions(producer_id="decode"), publishing=Publishing(tier, tier, marks=tier))
    await engine.start()
    return engine


async def _put_request(engine: Engine, attention_layers: range) -> None:
    payload = bytes(range(256)) * (4 * 256 * 2 // 256)
    for shard in SHARDS:
        for i, (end, prefix) in enumerate(BOUNDS):
            keys = [StateKey(NS, Kind.KV, layer, prefix, end - 16, end, shard) for layer in attention_layers]
            keys += [StateKey(NS, Kind.SSM, layer, prefix, 0, end, shard) for layer in SSM_LAYERS]
            for key in keys:
                await engine.put(PutRequest("default", key, Provenance("req-1", step=i), SPECS), payload)


async def _lookup_round_trips(url: str, attention_layers: range, counter: RoundTrips) -> tuple[int, int, int]:
    """(socket sends, exchanges, objects) of one leased lookup; then every object loads."""
    engine = await _engine(url)
    try:
        await _put_request(engine, attention_layers)
        request = LookupRequest("default", NS, tuple(attention_layers), SSM_LAYERS, BOUNDS, shards=SHARDS)
        counter.reset()
        hit = await engine.lookup(request, owner="decode")
        sends, exchanges = counter.sends, counter.exchanges
        assert hit.tokens == 64
        assert len(hit.objects) == len(SHARDS) * (len(SSM_LAYERS) + 4 * len(attention_layers))
        for ref, _ in hit.objects:
            loaded = await engine.load(LoadRequest("default", NS, ref=ref), owner="decode")
            assert len(bytes(loaded.payload)) == 4 * 256 * 2
            await engine.release(loaded.lease_id, "decode")
        await engine.release_owner("decode")
        return sends, exchanges, len(hit.objects)
    finally:
        await engine.close()


async def test_a_whole_request_lookup_costs_round_trips_independent_of_its_layers(redis_url, monkeypatch) -> None:
    url, is_cluster = redis_url
    counter = RoundTrips(monkeypatch)
    small = await _lookup_round_trips(url, range(2), counter)
    large = await _lookup_round_trips(url, range(24), counter)
    assert large[2] > 8 * small[2] // 2  # 196 objects against 20
    assert large[1] == small[1] <= 2  # exchanges: trip 1 the key indexes, trip 2 manifests and heads
    if not is_cluster:
        assert large[0] == small[0] <= 2  # nothing else was written to the server


async def test_locating_a_key_is_one_lookup_of_many_keys_round_trips_included(redis_url, monkeypatch) -> None:
    # a load by key (``Engine.locate``) asks the tier once, the stream heads riding along:
    # the round trips of one key's candidates do not grow with how many versions it holds
    url, is_cluster = redis_url
    counter = RoundTrips(monkeypatch)
    engine = await _engine(url)
    try:
        payload = bytes(range(256)) * (4 * 256 * 2 // 256)
        trips = []
        for boundary, requests in enumerate((1, 6)):
            key = StateKey(NS, Kind.SSM, 7, CHAIN[boundary], 0, 16 * (boundary + 1))
            refs = [(await engine.put(PutRequest("default", key, Provenance(f"r{n}", step=0), SPECS), payload)).ref
                    for n in range(requests)]
            counter.reset()
            found = await engine.locate(refs[0].key)  # the key as stored: in the tenant's own namespace
            trips.append((counter.sends, counter.exchanges))
            assert sorted(meta.object_id for meta, _ in found) == sorted(ref.state_id for ref in refs)
            loaded = await engine.load(LoadRequest("default", NS, key=key), owner="decode")
            assert loaded.header.state_id in {ref.state_id for ref in refs}
            await engine.release(loaded.lease_id, "decode")
        assert trips[0][1] == trips[1][1] <= 2
        if not is_cluster:
            assert trips[0][0] == trips[1][0] <= 2
    finally:
        await engine.close()
