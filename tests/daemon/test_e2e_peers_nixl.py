"""End to end over NIXL (``make test-nixl``): every test of ``test_e2e_peers`` again, its
daemons started with ``peers.transport = "nixl"``, plus what only NIXL has.

Skipped unless ``nixl_cu12`` imports (the ``nixl`` extra). Real ``statetier serve`` processes,
real NIXL agents over UCX (``UCX_TLS=tcp`` unless the environment names other transports),
a real redis-server holding the directory and the agents' signed metadata. The re-run tests
are the same functions (published objects pulled by ref and by key, an owner killed or
stopped: a typed miss, fenced; the Redis copy under ``descriptor+bytes``; a daemon of another
keyring refused; a lookup's joint hit; an owner restarted on its address offered again);
here: the pulls were NIXL reads into decode's arena (no per-pull registration), and forged
agent metadata in the directory is refused at the puller, counted, and nothing served.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import redis

from statetier.clients import Client
from statetier.launch import DaemonProcess
from statetier.protocol.errors import PeerLost, Unauthorized
from statetier.tiers.peer import nixlmeta
from statetier.tiers.peer.directory import Descriptor
from tests.daemon import test_e2e_peers as tcp
from tests.support.jamba import assert_same_tensors, snapshot
from tests.support.keyrings import keyring_file

pytest.importorskip("nixl_cu12._api")

#: what only the TCP wire does: a batch as one PULL_MANY answered back to back (NIXL reads each
#: object itself: ``NixlTransport.pull_many``), counted by the owner's ``pull_batches_answered``
TCP_WIRE_ONLY = {"test_a_batch_is_one_pull_and_each_pulled_byte_is_copied_once_on_the_decode_side"}

for _name, _test in vars(tcp).items():  # the TCP transport's end-to-end tests, collected here again
    if _name.startswith("test_") and _name not in TCP_WIRE_ONLY:
        globals()[_name] = _test


@pytest.fixture(autouse=True)
def over_nixl(monkeypatch):
    monkeypatch.setitem(tcp.PEERS, "peers.transport", "nixl")
    monkeypatch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp"))


def nixl_counts(proc: DaemonProcess) -> dict[str, int]:
    """The peer tier's ``statetier_peer_nixl_*`` counters, by name less the prefix."""
    out: dict[str, int] = {}
    for (sample, _labels), value in proc.scrape().values.items():
        if sample.startswith("statetier_peer_nixl_"):
            name = sample.removeprefix("statetier_peer_nixl_").removesuffix("_total")
            out[name] = out.get(name, 0) + int(value)
    return out


def test_the_pulls_are_nixl_reads_into_the_arena(fresh_redis):
    with keyring_file() as keyring, tcp.daemon("prefill", fresh_redis.url, keyring) as prefill, \
            tcp.daemon("decode", fresh_redis.url, keyring) as decode:
        refs = tcp.put_published(prefill, seed=80)
        assert len(tcp.redis_keys(fresh_redis.url, "st:peer:nixl:*")) == 2  # each daemon's agent, signed
        with Client(decode.url, namespace=tcp.SPEC) as client:
            for index, ref in enumerate(refs):
                assert_same_tensors(client.load(ref), snapshot(80 + 2 * index + 1))
        counted = nixl_counts(decode)
        assert counted["reads"] == 2 and counted["inline"] == 0 and counted["metadata_refused"] == 0
        assert counted["registered_per_pull"] == 0  # promotions land in decode's arena, registered at start
        assert decode.counters().get("hits peer", 0) == 2


def test_forged_agent_metadata_in_the_directory_is_refused_and_nothing_is_served(fresh_redis):
    with keyring_file() as keyring, tcp.daemon("prefill", fresh_redis.url, keyring) as prefill, \
            tcp.daemon("decode", fresh_redis.url, keyring) as decode:
        refs = tcp.put_published(prefill, seed=90)
        with contextlib.closing(redis.Redis.from_url(fresh_redis.url)) as r:
            owner = Descriptor.decode(r.get(f"st:peer:obj:{refs[0].state_id.hex()}")).owner
            key = nixlmeta.board_key(owner)  # prefill's agent
            genuine = r.get(key)
            assert genuine is not None
            forged = bytearray(genuine)
            forged[-3] ^= 0x40  # the worker address an intruder would put there
            r.set(key, bytes(forged))
            with Client(decode.url, namespace=tcp.SPEC) as client:
                with pytest.raises(Unauthorized):
                    client.load(refs[0])
            assert nixl_counts(decode)["metadata_refused"] == 1 and nixl_counts(decode)["reads"] == 0
            r.set(key, genuine)
        with Client(decode.url, namespace=tcp.SPEC) as client:
            assert_same_tensors(client.load(refs[1]), snapshot(93))
        assert nixl_counts(decode)["reads"] == 1


def test_an_owner_killed_between_two_reads_is_peer_lost(fresh_redis):
    with keyring_file() as keyring, tcp.daemon("prefill", fresh_redis.url, keyring) as prefill, \
            tcp.daemon("decode", fresh_redis.url, keyring) as decode:
        refs = tcp.put_published(prefill, seed=100)
        with Client(decode.url, namespace=tcp.SPEC) as client:
            assert_same_tensors(client.load(refs[0]), snapshot(101))  # its agent added at decode
            prefill.kill()
            with pytest.raises(PeerLost):
                client.load(refs[1])
