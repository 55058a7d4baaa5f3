"""BoundedLru: the one bounded least-recently-used mapping (protocol/lru.py)."""

from __future__ import annotations

import threading

import pytest

from statetier.protocol.lru import BoundedLru


def test_the_least_recently_used_entry_goes_first_and_a_hit_makes_an_entry_recent():
    lru: BoundedLru[str, int] = BoundedLru(3)
    for key, value in (("a", 1), ("b", 2), ("c", 3)):
        lru.put(key, value)
    assert lru.get("a") == 1  # a is now the most recent: b is the oldest
    lru.put("d", 4)
    assert ("a" in lru, "b" in lru, "c" in lru, "d" in lru) == (True, False, True, True)
    assert lru.peek("c") == 3  # a peek leaves c the oldest
    lru.put("e", 5)
    assert "c" not in lru and len(lru) == 3


def test_put_of_a_known_key_replaces_its_value_and_makes_it_recent():
    lru: BoundedLru[str, int] = BoundedLru(2)
    lru.put("a", 1)
    lru.put("b", 2)
    lru.put("a", 10)
    lru.put("c", 3)
    assert (lru.peek("a"), lru.peek("b"), lru.peek("c")) == (10, None, 3)


def test_pop_discard_and_clear_remove_entries():
    lru: BoundedLru[str, int] = BoundedLru(4)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.pop("a") == 1 and lru.pop("a") is None
    lru.discard("b")
    lru.discard("missing")
    lru.put("c", 3)
    lru.clear()
    assert len(lru) == 0 and lru.get("c") is None


def test_a_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        BoundedLru(0)


def test_threads_sharing_one_lru_never_leave_it_over_capacity():
    lru: BoundedLru[int, int] = BoundedLru(64)

    def churn(base: int) -> None:
        for i in range(5000):
            lru.put(base + i % 200, i)
            lru.get(base + (i * 7) % 200)
            lru.pop(base + (i * 13) % 200)

    threads = [threading.Thread(target=churn, args=(n * 1000,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(lru) <= 64
