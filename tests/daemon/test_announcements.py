"""daemon.engine.announcements over a real ``Tenancy``: the charges are what is announced.

Every copy charged to a tier where it was not is one ``BlockStored`` for that tier's medium;
every charge given back one ``BlockRemoved``; a copy charged again, a refund of a copy never
charged, and any copy of an object put before the daemon started (no record) say nothing. The
sink is a list: these tests are about which events, not how they travel (test_e2e_events.py).
"""

from __future__ import annotations

from statetier.daemon.engine.announcements import Announcements
from statetier.daemon.engine.tenancy import Tenancy
from statetier.daemon.requests import PutRequest
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.kv_events import BlockRemoved, BlockStored, BlockTag
from statetier.tiers.base import ObjectMeta

NS = NamespaceSpec(model_id="announced").namespace()
MEDIA = {"host": "CPU", "disk": "DISK", "redis": "REDIS"}


class Heard(list):
    def emit(self, tenant, namespace, event):
        self.append((tenant, namespace, event))


def announced() -> tuple[Announcements, Tenancy, Heard]:
    heard = Heard()
    announcements = Announcements(heard, MEDIA)
    return announcements, Tenancy(observer=announcements), heard


def put(announcements: Announcements, n: int, tag: BlockTag | None = None) -> bytes:
    key = StateKey(NS, Kind.KV, 0, bytes([n]) * 32, 32, 48)
    meta = ObjectMeta(bytes([n]) * 16, key.digest(), bytes(16), 1, Kind.KV, 100, 50)
    announcements.record_put(PutRequest("t", key, Provenance("r"), (), tag=tag), meta)
    return meta.object_id


def test_a_put_its_copies_and_moves_are_announced_per_medium_in_order():
    announcements, tenancy, heard = announced()
    oid = put(announcements, 1, BlockTag(b"h" * 32, b"p" * 32, (1, 2, 3)))
    tenancy.charge("t", "host", oid, 100)       # the put lands in the arena
    tenancy.copied("host", "disk", oid)         # write-behind
    tenancy.moved("host", "redis", oid)         # a demotion (past the disk copy)
    tenancy.refund("disk", oid)                 # a delete's sweep
    tenancy.refund("redis", oid)
    stored = BlockStored((b"h" * 32,), b"p" * 32, (1, 2, 3), 16, "CPU")
    assert heard == [("t", NS.digest, stored),
                     ("t", NS.digest, BlockStored(stored.block_hashes, stored.parent_block_hash, stored.token_ids,
                                                  16, "DISK")),
                     ("t", NS.digest, BlockStored(stored.block_hashes, stored.parent_block_hash, stored.token_ids,
                                                  16, "REDIS")),
                     ("t", NS.digest, BlockRemoved((b"h" * 32,), "CPU")),
                     ("t", NS.digest, BlockRemoved((b"h" * 32,), "DISK")),
                     ("t", NS.digest, BlockRemoved((b"h" * 32,), "REDIS"))]
    assert len(announcements) == 0  # no tier holds it: the record is gone


def test_without_a_tag_the_block_is_the_keys_prefix_hash_and_its_span():
    announcements, tenancy, heard = announced()
    tenancy.charge("t", "host", put(announcements, 2), 100)
    assert heard == [("t", NS.digest, BlockStored((b"\x02" * 32,), None, (), 16, "CPU"))]


def test_a_copy_charged_again_and_a_refund_of_nothing_say_nothing():
    announcements, tenancy, heard = announced()
    oid = put(announcements, 3)
    tenancy.charge("t", "host", oid, 100)
    tenancy.charge("t", "host", oid, 100)       # a promotion into a tier that holds it
    tenancy.refund("disk", oid)                 # a delete sweeping a tier that never held it
    assert [type(event).__name__ for _, _, event in heard] == ["BlockStored"]
    assert tenancy.usage() == {"t": {"host": 100}}


def test_an_object_put_before_the_daemon_started_is_never_announced():
    announcements, tenancy, heard = announced()
    tenancy.charge("t", "host", b"\x09" * 16, 100)  # promoted from disk after a restart: no record
    tenancy.refund("host", b"\x09" * 16)
    assert heard == []
