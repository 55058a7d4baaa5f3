"""The disk index entry (``tiers.disk.index``): format 2 records the object's namespace and
tenant (what ``statetier ls`` and ``purge`` select by); format 1 entries, written before,
still read, with both unknown; a restart keeps both."""

from __future__ import annotations

import dataclasses
import struct

from statetier.tiers.base import ObjectMeta
from statetier.tiers.disk.index import IndexEntry, Location
from tests.support.disk_crash_writer import NAMESPACE, load, make_object, object_id_for, store


def test_format_2_round_trips_namespace_and_tenant_and_format_1_still_reads() -> None:
    meta, _ = make_object(object_id_for(2, 0, 0))
    meta = dataclasses.replace(meta, tenant="tenant-a")
    entry = IndexEntry(Location(3, 4096, meta.size + 64, 1), meta)
    packed = entry.pack()
    assert packed[0] == 2
    back = IndexEntry.unpack(meta.object_id, packed)
    assert back == entry and (back.meta.namespace, back.meta.tenant) == (NAMESPACE.digest, "tenant-a")

    old = struct.Struct("<BIQQQBQQIQQBBB")  # format 1: no namespace, no tenant
    request_id = meta.request_id.encode()
    v1 = old.pack(1, 3, 4096, meta.size + 64, 1, int(meta.kind), meta.version, meta.size, meta.header_len,
                  meta.created_at_ns, meta.step, len(meta.key_digest), len(meta.stream_id), len(request_id)
                  ) + meta.key_digest + meta.stream_id + request_id
    read = IndexEntry.unpack(meta.object_id, v1)
    assert read.meta == meta and (read.meta.namespace, read.meta.tenant) == (b"", "")
    assert read.location == entry.location


async def test_a_restart_keeps_each_objects_namespace_and_tenant(open_disk) -> None:
    tier = await open_disk()
    meta, blob = make_object(object_id_for(2, 1, 0))
    await store(tier, dataclasses.replace(meta, tenant="tenant-b"), blob)
    await tier.close()
    reopened = await open_disk()
    (found,) = [m async for m in reopened.iter_objects()]
    assert isinstance(found, ObjectMeta) and (found.namespace, found.tenant) == (NAMESPACE.digest, "tenant-b")
    assert await load(reopened, meta.object_id) == blob
