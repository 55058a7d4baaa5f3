"""The host tier the host-tier tests start: ``tier`` (fixture), a 4 MiB arena, no pinning.

``MIB`` is the size unit they count in. Modules import ``tier`` by name (pytest finds a
fixture by the name a module holds it under).
"""

from __future__ import annotations

import pytest

from statetier.tiers.memory import HostTier, HostTierOptions

MIB = 1024 * 1024


@pytest.fixture
async def tier():
    async with HostTier(HostTierOptions(4 * MIB, pin_memory=False)) as host:
        yield host
