"""ExtentAllocator: exact placements, coalescing, and a property test of its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statetier.protocol.extents import ExtentAllocator

G = 4096


def assert_consistent(alloc: ExtentAllocator) -> None:
    """Extents tile the region exactly; no two free extents touch; counters agree."""
    extents = sorted([(o, s, "used") for o, s in alloc.iter_allocated()] + [(o, s, "free") for o, s in alloc.iter_free()])
    cursor, previous = 0, None
    for offset, size, kind in extents:
        assert offset == cursor, f"gap or overlap at {offset} (expected {cursor})"
        assert size > 0 and size % alloc.granularity == 0
        assert not (kind == previous == "free"), "two adjacent free extents were not merged"
        cursor, previous = offset + size, kind
    assert cursor == alloc.capacity
    assert alloc.used_bytes == sum(s for _, s in alloc.iter_allocated())
    assert alloc.free_bytes == sum(s for _, s in alloc.iter_free())
    assert alloc.largest_free == max((s for _, s in alloc.iter_free()), default=0)


def test_sizes_round_up_to_the_granule_and_pack_from_the_start() -> None:
    alloc = ExtentAllocator(16 * G)
    assert alloc.allocate(1) == 0
    assert alloc.allocate(G) == G
    assert alloc.allocate(G + 1) == 2 * G
    assert [alloc.size_of(o) for o in (0, G, 2 * G)] == [G, G, 2 * G]
    assert alloc.used_bytes == 4 * G and alloc.free_bytes == 12 * G
    assert_consistent(alloc)


def test_capacity_is_rounded_down_and_oversized_requests_get_none() -> None:
    alloc = ExtentAllocator(10 * G + 100)
    assert alloc.capacity == 10 * G
    assert alloc.allocate(10 * G + 1) is None
    assert alloc.allocate(10 * G) == 0
    assert alloc.allocate(1) is None


def test_free_coalesces_with_both_neighbours() -> None:
    alloc = ExtentAllocator(8 * G)
    a, b, c, d = (alloc.allocate(2 * G) for _ in range(4))
    alloc.free(a)
    alloc.free(c)
    assert list(alloc.iter_free()) == [(0, 2 * G), (4 * G, 2 * G)]
    assert alloc.fragmentation == pytest.approx(0.5)
    alloc.free(b)  # joins a and c into one extent
    assert list(alloc.iter_free()) == [(0, 6 * G)]
    alloc.free(d)
    assert list(alloc.iter_free()) == [(0, 8 * G)]
    assert alloc.fragmentation == 0.0
    assert_consistent(alloc)


def test_first_fit_within_a_class_then_the_next_class_up() -> None:
    alloc = ExtentAllocator(64 * G)
    offsets = [alloc.allocate(s * G) for s in (3, 1, 2, 1, 8, 1)]  # holes of 3, 2 and 8 granules
    for index in (0, 2, 4):
        alloc.free(offsets[index])
    # 2 granules: class 1 holds the 3- and the 2-granule hole; first fit takes the 3 (freed first)
    assert alloc.allocate(2 * G) == offsets[0]
    # 5 granules: class 2 is empty now, the 8-granule hole (class 3) is taken
    assert alloc.allocate(5 * G) == offsets[4]
    assert_consistent(alloc)


def test_allocate_lowest_finds_the_lowest_fit_below_a_limit() -> None:
    alloc = ExtentAllocator(32 * G)
    offsets = [alloc.allocate(2 * G) for _ in range(8)]
    for index in (1, 3, 6):
        alloc.free(offsets[index])
    assert alloc.allocate_lowest(2 * G, below=offsets[7]) == offsets[1]
    assert alloc.allocate_lowest(2 * G, below=offsets[3]) is None
    assert alloc.allocate_lowest(2 * G, below=offsets[7]) == offsets[3]
    assert_consistent(alloc)


def test_misuse_is_refused() -> None:
    alloc = ExtentAllocator(4 * G)
    with pytest.raises(ValueError):
        alloc.free(0)
    with pytest.raises(ValueError):
        alloc.allocate(0)
    offset = alloc.allocate(G)
    alloc.free(offset)
    with pytest.raises(ValueError):
        alloc.free(offset)  # double free
    with pytest.raises(ValueError):
        ExtentAllocator(G, granularity=3000)
    with pytest.raises(ValueError):
        ExtentAllocator(G - 1)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 40 * 1024)),
        st.tuples(st.just("lowest"), st.integers(1, 40 * 1024)),
        st.tuples(st.just("free"), st.integers(0, 10_000)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations, granularity=st.sampled_from([512, 4096]))
def test_random_sequences_never_overlap_and_fully_coalesce(ops, granularity) -> None:
    alloc = ExtentAllocator(256 * 1024, granularity)
    live: dict[int, int] = {}
    for op, arg in ops:
        if op == "free":
            if live:
                offset = sorted(live)[arg % len(live)]
                alloc.free(offset)
                del live[offset]
            continue
        had_room = alloc.largest_free >= alloc.rounded(arg)
        offset = alloc.allocate(arg) if op == "alloc" else alloc.allocate_lowest(arg)
        assert (offset is not None) == had_room  # fails only when no extent is big enough
        if offset is None:
            continue
        if op == "lowest":
            assert all(start > offset or size < alloc.rounded(arg) for start, size in alloc.iter_free() if start < offset)
        assert offset % granularity == 0 and alloc.size_of(offset) >= arg
        for other, size in live.items():
            assert offset + alloc.size_of(offset) <= other or other + size <= offset
        live[offset] = alloc.size_of(offset)
    assert_consistent(alloc)
    for offset in list(live):
        alloc.free(offset)
    assert list(alloc.iter_free()) == [(0, alloc.capacity)]
    assert alloc.used_bytes == 0 and alloc.fragmentation == 0.0
