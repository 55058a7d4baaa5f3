"""The host arena populated at start (issue 33, item 2): with ``populate=True`` the whole
arena is faulted in on a background thread, so writing a fresh 32 MiB into it takes a small
fraction of the faults it takes without (counted with ``getrusage``: no timing)."""

from __future__ import annotations

import resource

import pytest

from statetier.tiers.memory import HostTier, HostTierOptions

MIB = 1 << 20
SIZE = 32 * MIB


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


async def _faults_of_a_fresh_write(populate: bool) -> tuple[int, int]:
    async with HostTier(HostTierOptions(64 * MIB, pin_memory=False, populate=populate)) as host:
        population = host._arena.population
        if populate:
            assert population.done.wait(60)
            if population.populated_bytes == 0:
                pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
        arena, source = host.arena_view, b"\x01" * SIZE  # the source written (faulted in) before counting
        try:
            before = _faults()
            arena[8 * MIB : 8 * MIB + SIZE] = source
            return _faults() - before, population.populated_bytes
        finally:
            arena.release()


async def test_a_populated_arena_takes_no_first_touch_faults():
    cold, _ = await _faults_of_a_fresh_write(populate=False)
    warm, populated = await _faults_of_a_fresh_write(populate=True)
    assert populated == 64 * MIB
    assert cold >= SIZE // 4096 // 2  # without: a fault per page (or per few pages)
    assert warm < cold // 8, (warm, cold)
