"""Eviction order is a policy object behind one seam (``tiers.eviction``).

Story: the same eight objects, the same loads, evicted from a real host arena under the
default ``LruPolicy`` (a loaded object is spared) and under a first-in-first-out policy
written here in a few lines and handed to the tier's options (the load changes nothing):
each takes the exact order its policy says, and no part of the tier was edited for it.
"""

from __future__ import annotations

from collections import OrderedDict

from statetier.tiers.base import ObjectMeta
from statetier.tiers.eviction import LruPolicy
from statetier.tiers.memory.host import HostTier, HostTierOptions
from tests.support.tier_contract import load, make_object, store


class FirstInFirstOut:
    """Oldest stored first; a read does not refresh."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, ObjectMeta] = OrderedDict()

    def added(self, meta: ObjectMeta) -> None:
        self._order[meta.object_id] = meta

    def touched(self, object_id: bytes) -> None:
        pass

    def removed(self, object_id: bytes) -> None:
        self._order.pop(object_id, None)

    def order(self) -> list[ObjectMeta]:
        return list(self._order.values())


async def evicted_under(policy) -> list[str]:
    objects = {name: make_object(7_600) for name in "ABCDEFGH"}
    names = {meta.object_id: name for name, (meta, _) in objects.items()}
    options = HostTierOptions(10 * 8192, pin_memory=False, high_watermark=0.9, low_watermark=0.55,
                              eviction_policy=policy)
    async with HostTier(options) as tier:
        for meta, blob in objects.values():
            await store(tier, meta, blob)
        for name in "AB":
            await load(tier, objects[name][0].object_id)
        return [names[item.meta.object_id] for item in await tier.evict(need_bytes=12_000)]


async def test_each_eviction_policy_takes_its_own_order_through_the_same_tier() -> None:
    assert await evicted_under(LruPolicy) == ["C", "D", "E", "F"]  # A and B were loaded: spared
    assert await evicted_under(FirstInFirstOut) == ["A", "B", "C", "D"]  # the oldest, loaded or not
