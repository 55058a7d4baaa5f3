"""The peer tier in the engine's tier order: it describes, it never takes bytes.

Stories over a real host arena, a real disk tier and a real ``PeerTier`` on a redis-server
(the order the composition root builds: host, disk, peer): puts that fill the arena evict and
demote to disk, never into the peer tier (``holds_bytes = False``: nothing is described in
the directory that was not published); a put with ``publish`` describes its object (one
descriptor, no bytes in Redis) while its bytes stay in the arena; a delete withdraws the
descriptor. And the configuration: ``[peers]`` without ``redis.url`` is refused naming the
field; the per-namespace policy picks ``descriptor+bytes`` for the namespaces it names.
"""

from __future__ import annotations

import pytest

from statetier.daemon.config import Config, PeersConfig
from statetier.daemon.engine import Engine, EngineOptions, Publishing
from statetier.daemon.requests import PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, prefix_hashes
from statetier.protocol.keyring import Keyring
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.peer import PeerTier, PeerTierOptions
from statetier.tiers.registry import MemoryVersionRegistry

SPECS = (TensorSpec("ssm", "float32", (64, 60)),)  # one 16 KiB extent with its header
OBJECT_EXTENT = 16 * 1024
CHAIN = prefix_hashes(list(range(64)), 16)
NS = NamespaceSpec("peer-placement", tenant="alice").namespace()


def put_request(layer: int, publish: bool = False) -> PutRequest:
    key = StateKey(NS, Kind.SSM, layer, CHAIN[3], 0, 64)
    return PutRequest("alice", key, Provenance(f"r{layer}", 3), SPECS, publish=publish)


async def test_evictions_demote_past_the_peer_tier_and_a_publish_only_describes(tmp_path, fresh_redis):
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(4 * OBJECT_EXTENT, pin_memory=False, high_watermark=1.0, low_watermark=0.5))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)

    async def holds_locally(object_id: bytes) -> bool:
        return await host.contains(object_id) or await disk.contains(object_id)

    peer = PeerTier(PeerTierOptions(fresh_redis.url, owner_id="here"), keyring=keyring, local_tiers=[host, disk],
                    holds_locally=holds_locally)
    engine = Engine([host, disk, peer], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="peer-placement"), arena=host, publishing=Publishing(peer))
    for tier in (host, disk, peer):
        await tier.start()
    try:
        refs = [(await engine.put(put_request(layer), bytes(SPECS[0].nbytes))).ref for layer in range(8)]
        assert host.stats().evictions > 0
        assert all([await disk.contains(ref.state_id) or await host.contains(ref.state_id) for ref in refs])
        assert peer.published == 0 and peer.directory.commands == 0  # nothing demoted into a description

        published = await engine.put(put_request(9, publish=True), bytes(SPECS[0].nbytes))
        assert published.published and published.tier == "host"
        assert peer.published == 1
        descriptor = await peer.directory.get(published.ref.state_id)
        assert descriptor is not None and descriptor.owner == "here" and descriptor.meta.size > len(descriptor.header)
        assert not await peer.contains(published.ref.state_id)  # its own: not a copy a peer holds

        await engine.delete("alice", published.ref)
        assert await peer.directory.get(published.ref.state_id) is None
    finally:
        for tier in (peer, disk, host):
            await tier.close()


def test_peers_without_redis_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="peers.enabled needs redis.url"):
        Config.model_validate({"peers": {"enabled": True}})
    assert Config.model_validate({"peers": {"enabled": True}, "redis": {"url": "redis://h:1/0"}}).peers.enabled
    assert Config().peers.enabled is False  # no peers: today's write-through, unchanged


def test_the_per_namespace_policy_keeps_bytes_only_where_it_says() -> None:
    kept = bytes(range(32))
    peers = PeersConfig(namespace_policies={kept.hex(): "descriptor+bytes"})
    assert peers.keeps_bytes(kept) and not peers.keeps_bytes(bytes(32))
    assert PeersConfig(policy="descriptor+bytes").keeps_bytes(bytes(32))
