"""What the composition root declares about publishing (``daemon.engine.publishing``), read
from the tiers it built, never probed at a call site.

- With Redis alone: a publish goes to the Redis tier, which is the shared tier and keeps the
  cluster's purge marks (it declares ``tiers.base.PurgeMarkStore``).
- With peers: a publish is described by the peer tier; the Redis tier beside it is the shared
  one, keeps the marks, and takes a publish's bytes only for the namespaces the policy names.
- Without Redis: nothing to publish to, no marks.
"""

from __future__ import annotations

from statetier.daemon.app import build_tiers
from statetier.daemon.config import Config
from statetier.daemon.engine import Publishing
from statetier.daemon.peer_address import PeerAddress
from statetier.tiers.base import PurgeMarkStore
from statetier.tiers.peer import PeerTier
from statetier.tiers.redis import RedisTier
from tests.support.tier_contract import KEYRING

LOOPBACK = PeerAddress("127.0.0.1", 0, "", "a test's")
URL = "redis://127.0.0.1:1"  # built, never started


def _publishing(settings: dict, peers: bool = False) -> tuple[list, Publishing]:
    config = Config.model_validate({"disk": {"enabled": False}, **settings})
    tiers, roles = build_tiers(config, KEYRING, None, peer_address=LOOPBACK if peers else None)
    return tiers, roles["publishing"]


def test_redis_alone_is_the_publish_target_the_shared_tier_and_the_purge_mark_store() -> None:
    tiers, publishing = _publishing({"redis": {"url": URL}})
    (redis_tier,) = [t for t in tiers if isinstance(t, RedisTier)]
    assert isinstance(redis_tier, PurgeMarkStore)  # declared by the tier, checked once by the root
    assert (publishing.target, publishing.shared, publishing.marks) == (redis_tier, redis_tier, redis_tier)
    assert publishing.bytes_beside(bytes(32)) is None  # the publish already is the bytes


def test_with_peers_the_peer_tier_describes_and_redis_beside_it_keeps_marks_and_chosen_bytes() -> None:
    kept = bytes(range(32))
    tiers, publishing = _publishing({"redis": {"url": URL}, "peers": {
        "enabled": True, "namespace_policies": {kept.hex(): "descriptor+bytes"}}}, peers=True)
    (peer,) = [t for t in tiers if isinstance(t, PeerTier)]
    (redis_tier,) = [t for t in tiers if isinstance(t, RedisTier)]
    assert not isinstance(peer, PurgeMarkStore) and not peer.holds_bytes
    assert (publishing.target, publishing.shared, publishing.marks) == (peer, redis_tier, redis_tier)
    assert publishing.bytes_beside(kept) is redis_tier and publishing.bytes_beside(bytes(32)) is None


def test_without_redis_there_is_nothing_to_publish_to_and_no_marks() -> None:
    _, publishing = _publishing({})
    assert publishing == Publishing()
    assert publishing.bytes_beside(bytes(32)) is None
