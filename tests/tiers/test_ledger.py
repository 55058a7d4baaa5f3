"""Ledger: the one bookkeeping object every tier's parts share (tiers/ledger.py)."""

from __future__ import annotations

import pytest

from statetier.protocol.errors import LeaseError
from statetier.protocol.identity import Kind
from statetier.tiers.base import ObjectMeta
from statetier.tiers.ledger import Ledger


def meta(n: int, size: int) -> ObjectMeta:
    oid = n.to_bytes(16, "big")
    return ObjectMeta(oid, b"k" * 32, oid, 1, Kind.KV, size, 0)


def test_a_store_in_progress_reserves_its_bytes_until_it_is_closed_once():
    ledger: Ledger[str] = Ledger("t", lease_ttl=30.0)
    first, second = meta(1, 100), meta(2, 50)
    ticket = ledger.open_store(first, location="where")
    other = ledger.open_store(second, location="there")
    assert (ledger.is_storing(first.object_id), ledger.is_open(ticket), ledger.reserved_bytes) == (True, True, 150)
    assert ledger.close_store(ticket) is True
    assert ledger.close_store(ticket) is False  # completed before: nothing more is released
    assert (ledger.is_storing(first.object_id), ledger.is_open(ticket), ledger.reserved_bytes) == (False, False, 50)
    assert ledger.close_all_stores() == [other] and ledger.reserved_bytes == 0 and not ledger.stores


def test_an_object_deleted_under_a_lease_is_reaped_only_when_its_last_lease_ends():
    ledger: Ledger[int] = Ledger("t", lease_ttl=30.0)
    kept, gone = meta(1, 100), meta(2, 40)
    ledger.index.add(kept)
    ledger.index.add(gone)
    first = ledger.leases.grant(gone, owner="a")
    second = ledger.leases.grant(gone, owner="b")
    ledger.index.remove(gone.object_id)
    ledger.hide(gone, 4096)
    assert (ledger.held_bytes, ledger.bytes_used, ledger.is_hidden(gone.object_id)) == (140, 140, True)
    assert ledger.leases.leased_bytes() == 40  # two leases, one object: counted once
    ledger.leases.release(first)
    assert ledger.reap(gone.object_id) is None and ledger.reap_all() == []
    ledger.leases.release(second)
    assert ledger.reap(gone.object_id) == (gone, 4096)
    assert (ledger.held_bytes, ledger.is_hidden(gone.object_id), ledger.reap_all()) == (100, False, [])


def test_reap_all_hands_back_every_hidden_object_no_lease_holds():
    ledger: Ledger[str] = Ledger("t", lease_ttl=30.0)
    a, b, c = meta(1, 10), meta(2, 20), meta(3, 30)
    lease = ledger.leases.grant(b, owner=None)
    for m, place in ((a, "pa"), (b, "pb"), (c, "pc")):
        ledger.hide(m, place)
    assert ledger.reap_all() == [(a, "pa"), (c, "pc")]
    assert (ledger.hidden_bytes, list(ledger.hidden)) == (20, [b.object_id])
    ledger.leases.release(lease)
    assert ledger.reap_all() == [(b, "pb")] and ledger.hidden_bytes == 0


def test_forget_all_leaves_an_empty_ledger_and_keeps_the_counters():
    ledger: Ledger[str] = Ledger("t", lease_ttl=30.0)
    ledger.index.add(meta(1, 10))
    ledger.open_store(meta(2, 20), location=None)
    ledger.hide(meta(3, 30), "p")
    ledger.evictions, ledger.corrupt_dropped = 2, 1
    ledger.forget_all()
    assert (len(ledger.index), ledger.stores, ledger.hidden, ledger.bytes_used) == (0, {}, {}, 0)
    assert (ledger.evictions, ledger.corrupt_dropped) == (2, 1)


def test_leases_expire_on_the_ledgers_clock_and_only_on_it(clock):
    ledger: Ledger[str] = Ledger("t", lease_ttl=30.0, clock=clock)
    object_ = meta(1, 100)
    default, short = ledger.leases.grant(object_, "a"), ledger.leases.grant(object_, "b", ttl=5.0)
    assert (default.deadline, short.deadline) == (clock() + 30.0, clock() + 5.0)

    clock.advance(5.0)  # a deadline is the last instant a lease still holds
    assert ledger.leases.check(short) is short and ledger.leases.expire() == 0
    clock.advance(0.5)
    with pytest.raises(LeaseError):
        ledger.leases.check(short)
    assert ledger.leases.check(default) is default and ledger.leases.is_leased(object_.object_id)

    clock.advance(25.0)
    assert (ledger.leases.expire(), ledger.leases.expired_total, len(ledger.leases)) == (1, 2, 0)
    assert not ledger.leases.is_leased(object_.object_id)

