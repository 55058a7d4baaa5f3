"""The host tier the host-tier tests start: ``tier`` (fixture), a 4 MiB arena, no pinning.

``MIB`` is the size unit they count in. Modules import ``tier`` by name (pytest finds a
fixture by the name a module holds it under). ``offset_in_arena(host, object_id)``: where an
object's bytes start in the arena (found by its bytes: a sealed object's header is unique),
for a test that flips a byte there.
"""

from __future__ import annotations

import pytest

from statetier.tiers.memory import HostTier, HostTierOptions

MIB = 1024 * 1024


async def offset_in_arena(host: HostTier, object_id: bytes) -> int:
    lease = await host.prepare_load(object_id)
    try:
        stored = bytes(await host.read(lease))
    finally:
        await host.complete_load(lease)
    arena = host.arena_view
    try:
        offset = bytes(arena).find(stored)
    finally:
        arena.release()
    assert offset >= 0
    return offset


@pytest.fixture
async def tier():
    async with HostTier(HostTierOptions(4 * MIB, pin_memory=False)) as host:
        yield host
