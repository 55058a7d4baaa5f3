"""Which transport a peer tier pulls with (``peers.transport``), and the NIXL agent metadata's
signature: both without NIXL installed (the default suite).

- ``"tcp"`` is the default and the peer tier's own ``TcpTransport``; ``"nixl"`` where
  ``nixl_cu12`` does not import is a ``ConfigError`` naming ``peers.transport`` and the extra,
  at start (before any listener), in process and from ``statetier serve``; anything else is
  refused by the config.
- The metadata blob verifies under the cluster keyring and names its agent; a flipped byte
  (metadata or MAC), another cluster's keyring, another agent's name, a truncated blob: all
  ``Unauthorized``.
"""

from __future__ import annotations

import pytest

from statetier.daemon.app import build_tiers
from statetier.daemon.config import Config
from statetier.daemon.peer_address import PeerAddress
from statetier.launch.daemons import DaemonFailed, DaemonProcess
from statetier.protocol.errors import ConfigError, Unauthorized
from statetier.protocol.keyring import Keyring
from statetier.tiers.peer import PeerTier, PeerTierOptions, nixlmeta
from statetier.tiers.peer.nixl import make_transport
from statetier.tiers.peer.nixlagent import importable
from statetier.tiers.peer.transport import TcpTransport
from tests.support.tier_contract import KEYRING

LOOPBACK = PeerAddress("127.0.0.1", 0, "", "a test's")
NO_NIXL = pytest.mark.skipif(importable() is None, reason="nixl_cu12 imports here: the refusal cannot happen")
OPTIONS = PeerTierOptions("redis://127.0.0.1:1", owner_id="o")


def test_tcp_is_the_default_and_the_peer_tiers_own_transport() -> None:
    assert Config().peers.transport == "tcp"
    assert make_transport("tcp", KEYRING, OPTIONS, None) is None
    peer = PeerTier(OPTIONS, keyring=KEYRING, local_tiers=[], holds_locally=_never,
                    transport=make_transport("tcp", KEYRING, OPTIONS, None))
    assert type(peer.transport) is TcpTransport


def test_an_unknown_transport_is_refused() -> None:
    with pytest.raises(ValueError, match="transport"):
        Config.model_validate({"peers": {"transport": "udp"}})
    with pytest.raises(ConfigError, match="peers.transport"):
        make_transport("udp", KEYRING, OPTIONS, None)


@NO_NIXL
def test_nixl_asked_for_but_not_installed_names_the_setting_and_the_extra() -> None:
    config = Config.model_validate({"redis": {"url": "redis://127.0.0.1:1"},
                                    "peers": {"enabled": True, "transport": "nixl"}, "disk": {"enabled": False}})
    with pytest.raises(ConfigError) as refused:
        build_tiers(config, KEYRING, None, peer_address=LOOPBACK)
    assert 'peers.transport = "nixl"' in refused.value.message
    assert "statetier[nixl]" in refused.value.message and "nixl_cu12" in refused.value.message


@NO_NIXL
def test_statetier_serve_with_nixl_not_installed_exits_naming_the_setting(fresh_redis) -> None:
    daemon = DaemonProcess(name="nixl-missing", redis_url=fresh_redis.url,
                           settings={"peers.enabled": "true", "peers.transport": "nixl"})
    try:
        with pytest.raises(DaemonFailed, match="exited with 2"):
            daemon.start()
        assert 'peers.transport = "nixl" needs NIXL' in daemon.log_text()
        assert not daemon.socket_path.exists()
    finally:
        daemon.close()


def test_signed_agent_metadata_verifies_and_names_its_agent() -> None:
    blob = nixlmeta.sign(KEYRING, "prefill/1a2b", b"\x00ucx-worker-address\xff")
    assert nixlmeta.verify(KEYRING, "prefill/1a2b", blob) == b"\x00ucx-worker-address\xff"
    assert nixlmeta.board_key("prefill/1a2b") == "st:peer:nixl:prefill/1a2b"


@pytest.mark.parametrize("at", [0, 9, 20, -1], ids=["key id", "name", "mac", "metadata"])
def test_a_flipped_byte_anywhere_in_the_metadata_blob_is_refused(at: int) -> None:
    blob = bytearray(nixlmeta.sign(KEYRING, "owner", b"metadata" * 8))
    blob[at] ^= 0x01
    with pytest.raises(Unauthorized):
        nixlmeta.verify(KEYRING, "owner", bytes(blob))


def test_metadata_signed_by_another_cluster_or_for_another_agent_is_refused() -> None:
    with pytest.raises(Unauthorized):
        nixlmeta.verify(KEYRING, "owner", nixlmeta.sign(Keyring.generate(), "owner", b"metadata"))
    with pytest.raises(Unauthorized, match="names"):
        nixlmeta.verify(KEYRING, "owner", nixlmeta.sign(KEYRING, "intruder", b"metadata"))
    with pytest.raises(Unauthorized, match="truncated"):
        nixlmeta.verify(KEYRING, "owner", b"\x00" * 4)


async def _never(object_id: bytes) -> bool:
    return False
