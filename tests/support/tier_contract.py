"""What the cross-tier contract suite (``test_contract.py``) runs against: real tiers, real objects.

- ``TIER_KINDS``       — ``host``, ``device-cpu``, ``disk``, ``redis``, ``redis-cluster``, ``peer``.
- ``tier`` (fixture)   — one started tier of each kind, with room for ``SLOTS`` test objects
                         (``CAPACITY`` bytes, ``capacity_bytes`` set on Redis too), its leases on
                         the test's ``clock`` (tests/conftest.py), closed after.
                         Redis tiers get a fresh ``key_prefix`` and their keys are deleted after.
                         The peer tier (``holds_bytes = False``) is a puller's, on a fresh
                         redis-server (the directory), beside an ``Owner`` in the same process:
                         another daemon's host tier and peer tier, pulled from over real TCP.
- ``Owner``            — where the suite's objects are held for a tier that takes no bytes:
                         ``store`` puts them in the owner's host tier and publishes them through
                         its peer tier; ``remove`` withdraws and deletes them there.
- ``executor`` (fixture) — the one-thread executor the tier runs its blocking work in;
                         ``settle(executor)`` waits until every job queued before now has ended.
- ``make_object(payload_bytes)`` — a sealed KV page (``seal_object`` under ``KEYRING``, which
                         the disk and Redis tiers verify reads against) and its ``ObjectMeta``.
- ``store`` / ``load`` — the two-phase lifecycles as a caller pairs them, in ``try/finally``
                         (the tier-specific suites use them too); a tier that holds no bytes
                         gets its objects from its ``Owner``. ``remove`` deletes one (at the owner).
- ``needs_bytes(tier, story)`` — skips a story a tier that takes no bytes cannot tell (the
                         reason names the declaration, never the tier).
- ``assert_invisible`` / ``assert_visible`` — every way to find an object fails / finds
                         exactly it; ``listed(tier)`` is ``iter_objects`` as a list (nothing,
                         where the tier holds no bytes of its own).
- ``assert_quiet(tier, objects, bytes_used)`` — no lease, no store in flight (objects and
                         bytes: none, where the tier holds no bytes);
                         ``assert_full_capacity_fits(tier)`` — every byte is free again.
- ``assert_read_view_released(tier, meta, blob, keyring)`` — an extent tier's ``read`` is a
                         read-only view of the intact object, released at ``complete_load``.
- ``fragment(tier, sizes, seal)`` — an extent tier's region with holes, and a top object
                         held by a lease (the compaction-under-readers stories).
- ``store_then_cancel(tier, meta, blob, where)`` — a store cancelled at ``where``;
                         ``assert_cancelled_store_leaves_nothing`` — the extent tiers'
                         cancellation story around it.

Extent tiers (host, device) copy through their executor from ``INLINE_COPY_BYTES`` on, so the
suite's small objects take the threaded copy path, where a cancellation can land mid-copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import redis
import redis.cluster

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import NotFound
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, new_state_id
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import decode_header, open_sealed, seal_object
from statetier.tiers.base import Lease, ObjectMeta, Tier
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import DeviceTier, DeviceTierOptions, HostTier, HostTierOptions
from statetier.tiers.peer import PeerTier, PeerTierOptions
from statetier.tiers.redis import RedisTier, RedisTierOptions

TIER_KINDS = ["host", "device-cpu", "disk", "redis", "redis-cluster", "peer"]
KEYRING = Keyring.generate()
NAMESPACE = NamespaceSpec("test/tier-contract").namespace()
GRANULE = 4096  # the extent tiers' default granularity
PAYLOAD_BYTES = 48 * 1024
INLINE_COPY_BYTES = 8 * 1024
_layers = itertools.count()


def make_object(payload_bytes: int = PAYLOAD_BYTES) -> tuple[ObjectMeta, bytes]:
    """A sealed KV page of random bytes under a key of its own, and its metadata."""
    key = StateKey(NAMESPACE, Kind.KV, next(_layers), os.urandom(32), 0, 16)
    blob = seal_object(key, Provenance("contract-req", 0, "contract", 1),
                       [(TensorSpec("kv", "uint8", (payload_bytes,)), os.urandom(payload_bytes))],
                       keyring=KEYRING, state_id=new_state_id(), version=1)
    return ObjectMeta.from_header(decode_header(blob)), blob


HEADER_BYTES = make_object(16)[0].header_len  # every object of this suite has this header
OBJECT_BYTES = HEADER_BYTES + PAYLOAD_BYTES
SLOTS = 8
CAPACITY = SLOTS * -(-OBJECT_BYTES // GRANULE) * GRANULE


def object_of_size(size: int) -> tuple[ObjectMeta, bytes]:
    """An object whose sealed size is exactly ``size`` bytes."""
    meta, blob = make_object(size - HEADER_BYTES)
    assert meta.size == size
    return meta, blob


def chunks_of(meta: ObjectMeta, blob: bytes) -> list[memoryview]:
    """The blob as a writer hands it over: header, then the payload in two pieces."""
    view = memoryview(blob)
    middle = meta.header_len + (meta.size - meta.header_len) // 2
    return [view[: meta.header_len], view[meta.header_len : middle], view[middle:]]


@dataclass(frozen=True, slots=True)
class Owner:
    """Another daemon's tiers, holding the objects a tier that takes no bytes is tested with."""

    host: HostTier
    peer: PeerTier

    async def publish(self, meta: ObjectMeta, blob: bytes) -> None:
        await store(self.host, meta, blob)
        await store(self.peer, meta, blob)  # its descriptor into the directory

    async def withdraw(self, object_id: bytes) -> bool:
        withdrawn = await self.peer.delete(object_id)
        return await self.host.delete(object_id) and withdrawn


#: a tier that holds no bytes (``holds_bytes = False``) → the owner its objects are held by
OWNERS: weakref.WeakKeyDictionary[Tier, Owner] = weakref.WeakKeyDictionary()


async def store(tier: Tier, meta: ObjectMeta, blob: bytes) -> None:
    owner = OWNERS.get(tier)
    if owner is not None:  # a tier that takes no bytes: held and published by its owner
        await owner.publish(meta, blob)
        return
    ticket = await tier.prepare_store(meta)
    stored = False
    try:
        await tier.write(ticket, chunks_of(meta, blob))
        await tier.complete_store(ticket, success=True)
        stored = True
    finally:
        if not stored:
            await tier.complete_store(ticket, success=False)


async def load(tier: Tier, object_id: bytes, owner: object = "reader") -> bytes:
    lease = await tier.prepare_load(object_id, owner=owner)
    try:
        return bytes(await tier.read(lease))
    finally:
        await tier.complete_load(lease)


def needs_bytes(tier: Tier, story: str) -> None:
    """Skip a story a tier that takes no bytes of its own (``holds_bytes = False``) cannot tell."""
    if not tier.holds_bytes:
        pytest.skip(f"holds_bytes = False: {story}")


async def remove(tier: Tier, object_id: bytes) -> bool:
    """``tier.delete``; for a tier that takes no bytes, the owner withdraws and deletes it."""
    owner = OWNERS.get(tier)
    return await (owner.withdraw(object_id) if owner is not None else tier.delete(object_id))


async def listed(tier: Tier) -> list[ObjectMeta]:
    return [meta async for meta in tier.iter_objects()]


async def assert_invisible(tier: Tier, meta: ObjectMeta) -> None:
    assert not await tier.contains(meta.object_id)
    assert await tier.get_meta(meta.object_id) is None
    assert await tier.find_by_key(meta.key_digest) == []
    assert meta.object_id not in [m.object_id for m in await listed(tier)]
    with pytest.raises(NotFound):
        await tier.prepare_load(meta.object_id, owner="probe")


async def assert_visible(tier: Tier, meta: ObjectMeta) -> None:
    """``meta`` is found every way, and is the only object stored."""
    assert await tier.contains(meta.object_id)
    assert await tier.get_meta(meta.object_id) == meta
    assert await tier.find_by_key(meta.key_digest) == [meta]
    assert await listed(tier) == ([meta] if tier.holds_bytes else [])


async def assert_quiet(tier, objects: int, bytes_used: int) -> None:
    if not tier.holds_bytes:
        objects = bytes_used = 0  # what it finds is another daemon's
    stats = tier.stats()
    assert (stats.objects, stats.bytes_used, stats.leases, stats.inflight) == (objects, bytes_used, 0, 0)


async def assert_full_capacity_fits(tier) -> None:
    """Every byte is free: an object of exactly the capacity stores, reads back, and goes."""
    meta, blob = object_of_size(CAPACITY)
    await store(tier, meta, blob)
    assert await load(tier, meta.object_id) == blob
    assert await remove(tier, meta.object_id)
    await assert_quiet(tier, 0, 0)


async def assert_read_view_released(tier: Tier, meta: ObjectMeta, blob: bytes, keyring: Keyring) -> None:
    lease = await tier.prepare_load(meta.object_id)
    view = await tier.read(lease)
    assert view.readonly and bytes(view) == blob
    assert open_sealed(view, None, keyring).header.state_id == meta.object_id
    await tier.complete_load(lease)
    with pytest.raises(ValueError):
        bytes(view)  # released at complete_load: a late reader fails loudly


async def fragment(tier: Tier, sizes: list[int], seal) -> tuple[dict[bytes, bytes], tuple[ObjectMeta, bytes], Lease]:
    """Store an object of each payload size (``seal(size)`` → meta, blob), then a small one
    last (highest in the region, it fits any hole), and delete every other of the first:
    the live objects' bytes by id, the top object, and a lease of it taken by
    ``"slow client"`` (which keeps it from moving)."""
    live = {}
    for size in sizes:
        meta, blob = seal(size)
        await store(tier, meta, blob)
        live[meta.object_id] = blob
    top = seal(5_000)
    await store(tier, *top)
    for object_id in list(live)[::2]:
        await tier.delete(object_id)
        del live[object_id]
    return live, top, await tier.prepare_load(top[0].object_id, owner="slow client")


async def store_then_cancel(tier: Tier, meta: ObjectMeta, blob: bytes, where: str) -> None:
    """Store ``[blob]`` in a task and cancel it ``where``:

    - ``before_write``: waiting before ``write``; ``after_write``: waiting after it;
    - ``write_queued``: in ``write`` (the caller keeps the executor busy, so the copy waits);
    - ``write_copying``: in ``write`` 2 ms into the copy (the caller makes it take longer);
    - ``during_write``: in ``write``, or waiting after it when the copy was quicker.
    """
    gate, reached = asyncio.Event(), asyncio.Event()

    async def store_() -> None:
        ticket = await tier.prepare_store(meta)
        done = False
        try:
            if where != "after_write":
                reached.set()
            if where == "before_write":
                await gate.wait()
            await tier.write(ticket, [blob])
            if where in ("after_write", "during_write"):
                reached.set()
                await gate.wait()
            done = True
        finally:
            await tier.complete_store(ticket, done)

    task = asyncio.create_task(store_())
    await reached.wait()
    await asyncio.sleep(0)  # let the task reach its next await
    if where == "write_copying":
        await asyncio.sleep(0.002)  # the behaviour: a cancel landing 2 ms into the copy
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def assert_cancelled_store_leaves_nothing(open_tier, seal, size: int, where: str) -> None:
    """A store of ``seal(size)`` cancelled ``where`` (``store_then_cancel``) leaves nothing
    and the same object stores again. ``open_tier(executor)`` → an extent tier (used as an
    async context manager) that copies through ``executor``; for ``write_queued`` the copy
    job waits behind another until the cancel is in."""
    executor = ThreadPoolExecutor(1)
    release = threading.Event()
    try:
        async with open_tier(executor) as tier:
            meta, blob = seal(size)
            if where == "write_queued":
                executor.submit(release.wait)
            await store_then_cancel(tier, meta, blob, where)
            release.set()
            await settle(executor)
            assert not await tier.contains(meta.object_id)
            stats = tier.stats()
            assert (stats.objects, stats.bytes_used, stats.inflight) == (0, 0, 0)
            assert stats.extra["extent_bytes_allocated"] == 0
            await store(tier, meta, blob)  # the whole region is usable again
            assert await load(tier, meta.object_id) == blob
    finally:
        release.set()
        executor.shutdown()


async def settle(executor: ThreadPoolExecutor) -> None:
    """Wait for every job queued on the (one-thread) executor before now, and its callbacks."""
    await asyncio.wrap_future(executor.submit(lambda: None))


@pytest.fixture
def executor():
    pool = ThreadPoolExecutor(1, thread_name_prefix="contract")
    yield pool
    pool.shutdown(wait=True)


def _raw_redis(url: str, is_cluster: bool):
    return redis.cluster.RedisCluster.from_url(url) if is_cluster else redis.Redis.from_url(url)


def _drop_keys(url: str, is_cluster: bool, prefix: str) -> None:
    client = _raw_redis(url, is_cluster)
    try:
        for pattern in (f"{prefix}:*", f"{{{prefix}}}:*"):
            for key in list(client.scan_iter(match=pattern, count=500)):
                client.delete(key)
    finally:
        client.close()


def _build(kind: str, request, tmp_path, executor, clock) -> tuple[Tier, object]:
    """The tier, and a cleanup to run after it is closed (or ``None``)."""
    if kind == "host":
        return HostTier(HostTierOptions(CAPACITY, pin_memory=False, inline_copy_bytes=INLINE_COPY_BYTES, clock=clock),
            executor=executor), None
    if kind == "device-cpu":
        return DeviceTier(DeviceTierOptions(CAPACITY, device="cpu", inline_copy_bytes=INLINE_COPY_BYTES, clock=clock),
            executor=executor), None
    if kind == "disk":
        return DiskTier(DiskTierOptions(tmp_path / "disk", CAPACITY, segment_bytes=1 << 20, clock=clock),
            keyring=KEYRING, executor=executor), None
    is_cluster = kind == "redis-cluster"
    url = request.getfixturevalue("redis_cluster" if is_cluster else "redis_server").url
    prefix = f"contract-{uuid.uuid4().hex}"
    tier = RedisTier(RedisTierOptions(url, cluster=is_cluster, key_prefix=prefix, capacity_bytes=CAPACITY,
                                      clock=clock), keyring=KEYRING, executor=executor)
    return tier, lambda: _drop_keys(url, is_cluster, prefix)


async def _open_peer(request, clock, opened: contextlib.AsyncExitStack) -> PeerTier:
    """A puller's peer tier, and its ``Owner`` (another daemon's host and peer tiers), on a
    fresh redis-server as their directory; every tier closed by ``opened``."""
    url = request.getfixturevalue("fresh_redis").url
    run = uuid.uuid4().hex[:8]
    sides = []
    for side in ("owner", "puller"):
        host = await opened.enter_async_context(HostTier(HostTierOptions(CAPACITY, pin_memory=False)))
        peer = PeerTier(PeerTierOptions(url, owner_id=f"contract-{side}-{run}", pull_timeout=5.0, clock=clock),
                        keyring=KEYRING, local_tiers=[host], holds_locally=host.contains)
        sides.append((host, await opened.enter_async_context(peer)))
    (owner_host, owner_peer), (_, puller) = sides
    OWNERS[puller] = Owner(owner_host, owner_peer)
    return puller


@pytest.fixture(params=TIER_KINDS)
async def tier(request, tmp_path, executor, clock):
    async with contextlib.AsyncExitStack() as opened:
        if request.param == "peer":
            yield await _open_peer(request, clock, opened)
            return
        built, cleanup = _build(request.param, request, tmp_path, executor, clock)
        if cleanup is not None:
            opened.callback(cleanup)
        yield await opened.enter_async_context(built)
