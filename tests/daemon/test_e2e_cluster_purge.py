"""End to end: a purge reaches every daemon that shares Redis (issue 35 item 5).

Two daemon subprocesses (prefill, decode) sharing one redis-server and one keyring. Prefill
publishes; decode loads, which promotes copies into its own host arena. A purge on prefill
removes its copies and Redis's, and writes a purge mark there (``marked`` in the reply); the
decode daemon reads the mark on its next health probe and removes its promoted copies too
(a bounded wait: the probe runs in the background), so a load there is ``NotFound`` and
``ls`` shows nothing of the namespace (at once: ``ls`` reads the marks first). What decode puts after the purge stays, and so does the
other namespace. A decode daemon restarted after the purge also honours the mark at start.
"""

from __future__ import annotations

import pytest

from statetier.clients import Client
from statetier.protocol.errors import NotFound
from tests.support.daemons import daemon_fixture
from tests.support.jamba import assert_same_tensors, jamba_namespace, snapshot
from tests.support.keyrings import keyring_file
from tests.support.waiting import wait_until

PURGED, KEPT = jamba_namespace("purge-everywhere"), jamba_namespace("kept-everywhere")
PREFIX = bytes(range(32))
SETTINGS = {"redis.probe_interval_seconds": 0.5}


@pytest.fixture
def daemons(request, fresh_redis):
    with keyring_file() as keyring:
        prefill = daemon_fixture(request, name="prefill", redis_url=fresh_redis.url, keyring=keyring,
                                 settings=SETTINGS)
        decode = daemon_fixture(request, name="decode", redis_url=fresh_redis.url, keyring=keyring,
                                settings=SETTINGS)
        yield prefill, decode


def put_published(daemon, spec, seed: int):
    with Client(daemon.url, namespace=spec) as client:
        return [client.put_ssm(layer, PREFIX, 64, snapshot(seed + layer), request_id="r", publish=True)
                for layer in (1, 3)]


def objects_of(daemon, spec) -> int:
    with Client(daemon.url, namespace=spec) as client:
        own = client.owned_namespace.hex()
        return sum(row["objects"] for row in client.list_objects()["namespaces"] if row["namespace"] == own)


def test_a_purge_on_one_daemon_removes_the_promoted_copies_on_the_other(daemons) -> None:
    prefill, decode = daemons
    refs, kept = put_published(prefill, PURGED, 10), put_published(prefill, KEPT, 20)
    with Client(decode.url, namespace=PURGED) as client:
        for index, ref in enumerate(refs):
            assert_same_tensors(client.load(ref), snapshot(10 + 2 * index + 1))  # promoted into decode's host
    assert objects_of(decode, PURGED) == 2

    with Client(prefill.url, namespace=PURGED) as client:
        report = client.purge()
    assert report["marked"] is True and report["objects"] == 2

    wait_until(lambda: objects_of(decode, PURGED) == 0, "decode's copies purged by the mark", timeout=20.0)
    with Client(decode.url, namespace=PURGED) as client:
        for ref in refs:
            with pytest.raises(NotFound):
                client.load(ref)
        after = client.put_ssm(1, PREFIX, 64, snapshot(99), request_id="after")
    decode.restart()  # the mark is honoured again at start: what came after it stays
    with Client(decode.url, namespace=PURGED) as client:
        assert_same_tensors(client.load(after), snapshot(99))
    with Client(decode.url, namespace=KEPT) as client:
        for index, ref in enumerate(kept):
            assert_same_tensors(client.load(ref), snapshot(20 + 2 * index + 1))


@pytest.fixture
def slow_probe_daemons(request, fresh_redis):
    """As ``daemons``, but the health probe comes once an hour: what honours a mark here is
    the next load or lookup itself."""
    hourly = {"redis.probe_interval_seconds": 3600.0}
    with keyring_file() as keyring:
        yield (daemon_fixture(request, name="prefill", redis_url=fresh_redis.url, keyring=keyring, settings=hourly),
               daemon_fixture(request, name="decode", redis_url=fresh_redis.url, keyring=keyring, settings=hourly))


def test_the_next_load_and_lookup_after_another_daemons_purge_find_nothing_it_purged(slow_probe_daemons) -> None:
    prefill, decode = slow_probe_daemons
    refs, kept = put_published(prefill, PURGED, 30), put_published(prefill, KEPT, 40)
    with Client(decode.url, namespace=PURGED) as client:
        for ref in refs:
            client.load(ref)  # promoted into decode's host arena
        assert client.lookup([], [1, 3], [(64, PREFIX)], kv_layout="prefix", lease=False).tokens == 64
    assert objects_of(decode, PURGED) == 2

    with Client(prefill.url, namespace=PURGED) as client:
        assert client.purge()["marked"] is True

    with Client(decode.url, namespace=PURGED) as client:  # at once: no probe has run since
        assert client.lookup([], [1, 3], [(64, PREFIX)], kv_layout="prefix", lease=False).tokens == 0
        for ref in refs:
            with pytest.raises(NotFound):
                client.load(ref)
    assert objects_of(decode, PURGED) == 0  # swept, not only hidden
    with Client(decode.url, namespace=KEPT) as client:  # another namespace's copies stay
        for index, ref in enumerate(kept):
            assert_same_tensors(client.load(ref), snapshot(40 + 2 * index + 1))


def test_another_daemons_purge_is_gone_from_ls_at_once(slow_probe_daemons) -> None:
    """Issue 41: ``ls`` honours the cluster's purge marks before it lists, as a load does."""
    prefill, decode = slow_probe_daemons
    refs = put_published(prefill, PURGED, 50)
    with Client(decode.url, namespace=PURGED) as client:
        for ref in refs:
            client.load(ref)  # promoted into decode's host arena
    assert objects_of(decode, PURGED) == 2
    with Client(prefill.url, namespace=PURGED) as client:
        assert client.purge()["marked"] is True
    assert objects_of(decode, PURGED) == 0  # no load, lookup or probe in between
