"""End to end, daemon in a subprocess: /metrics scraped over HTTP says exactly what happened.

The daemon here serves only this module, so every counter delta is the test's own doing:

- puts: ``statetier_operations_total`` and ``statetier_bytes_total`` per tier/kind/op move
  by the number and the sealed size (header + payload, from INSPECT) of the puts — inline
  puts as op ``put`` (and ``store``) in the host tier, zero-copy puts as ``put`` in the host
  tier and ``put_reserve``/``put_commit`` at the daemon's door (tier ``daemon``); the
  write-behind copies to disk as ``store`` in the disk tier.
- loads: ``statetier_hits_total{tier,kind}``; a deleted ref and an unknown key
  ``statetier_misses_total{kind}``; refusals ``statetier_rejections_total{reason}`` (a
  superseded ref → ``stale``, a forged fingerprint → ``fingerprint``) and every failed
  request ``statetier_errors_total{reason}``; lookups ``statetier_lookup_hit_tokens``.
- A consumer whose every load is refused (the tensors it expects are not the stored ones)
  counts no hit: the refusals, and 0 in ``statetier_hits_total`` (issue 27 item 9; they
  used to count as hits, a 100% hit rate for a consumer that received nothing). Lookups
  count the tokens asked for beside those restored (the token hit ratio).
- Gauges read at scrape time equal STATS: tier used bytes, capacity, objects, leases;
  connections. ``/healthz`` and ``/readyz`` answer 200, an unknown path 404.
"""

from __future__ import annotations

import dataclasses

import pytest

from statetier.clients import AsyncClient
from statetier.protocol.errors import DestinationMismatch, FingerprintMismatch, NotFound, StaleState
from statetier.protocol.identity import prefix_hash
from tests.support.daemons import daemon_fixture
from tests.support.jamba import jamba_namespace, kv_page, snapshot
from tests.support.waiting import eventually

KV_PUTS, SSM_PUTS = 5, 3


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, name="metrics", host_capacity="128MiB")


async def sealed_size(client: AsyncClient, ref) -> int:
    header = (await client.inspect(ref.state_id))["header"]
    return header["header_len"] + header["payload_len"]


async def test_counters_move_by_exactly_what_the_clients_did(daemon) -> None:
    spec = jamba_namespace("metrics")
    before = daemon.scrape()
    async with AsyncClient(daemon.url, namespace=spec, use_shm=False) as inline, \
               AsyncClient(daemon.url, namespace=spec, use_shm=True) as zero_copy:
        kv_refs = [await inline.put_kv(layer, bytes(32), 0, 64, kv_page(layer, 64), request_id="m")
                   for layer in range(KV_PUTS)]
        ssm_refs = [await zero_copy.put_ssm(layer, bytes(32), 64, snapshot(layer), request_id="m")
                    for layer in range(SSM_PUTS)]
        for ref in kv_refs[:2] + ssm_refs:
            await inline.load(ref)
        superseded = ssm_refs[0]
        newer = await zero_copy.put_ssm(0, bytes(32), 64, snapshot(9), request_id="m")
        kv_bytes = sum([await sealed_size(inline, ref) for ref in kv_refs])
        ssm_bytes = sum([await sealed_size(inline, ref) for ref in [*ssm_refs, newer]])
        with pytest.raises(StaleState):
            await inline.load(superseded)
        with pytest.raises(StaleState):
            await inline.put_ssm(0, bytes(32), 64, snapshot(9), request_id="m", version=newer.version)
        with pytest.raises(FingerprintMismatch):
            await inline.load(dataclasses.replace(kv_refs[0], fingerprint=bytes(32)))
        async def kv_written_behind() -> bool:  # a delete racing its write-behind copy skips the store
            return daemon.scrape().delta(before, "statetier_operations_total", tier="disk", kind="kv",
                                         op="store") == KV_PUTS

        await eventually(kv_written_behind)
        assert await inline.delete(kv_refs[4]) >= 1
        with pytest.raises(NotFound):
            await inline.load(kv_refs[4])
        with pytest.raises(NotFound):
            await inline.load(inline.ssm_key(0, bytes(32), 65))

        hit = await inline.lookup(range(KV_PUTS - 1), [], [(64, bytes(32))], kv_layout="prefix")
        miss = await inline.lookup([0], [SSM_PUTS], [(64, bytes(32))], kv_layout="prefix", lease=False)
        await inline.release(hit.lease_ids)
        assert (hit.tokens, miss.tokens) == (64, 0)

        async def written_behind() -> bool:
            stats = await inline.stats()
            return stats["write_behind_pending"] == 0 and daemon.scrape().delta(
                before, "statetier_operations_total", tier="disk", kind="ssm", op="store") == SSM_PUTS + 1

        await eventually(written_behind)

    after = daemon.scrape()
    d = lambda name, **labels: after.delta(before, name, **labels)  # noqa: E731
    assert d("statetier_operations_total", tier="host", kind="kv", op="put") == KV_PUTS
    assert d("statetier_operations_total", tier="host", kind="kv", op="store") == KV_PUTS
    assert d("statetier_operations_total", tier="daemon", kind="kv", op="put") == KV_PUTS
    assert d("statetier_operations_total", tier="host", kind="ssm", op="put") == SSM_PUTS + 1
    # one PUT per put from the put window: no reserve, no commit (one round trip)
    assert d("statetier_operations_total", tier="daemon", kind="ssm", op="put") == SSM_PUTS + 1
    assert d("statetier_operations_total", tier="daemon", kind="ssm", op="put_reserve") == 0
    assert d("statetier_operations_total", tier="disk", kind="kv", op="store") == KV_PUTS
    assert d("statetier_bytes_total", tier="host", kind="kv", op="put") == kv_bytes
    assert d("statetier_bytes_total", tier="host", kind="ssm", op="put") == ssm_bytes

    assert d("statetier_hits_total", tier="host", kind="kv") == 2
    assert d("statetier_hits_total", tier="host", kind="ssm") == SSM_PUTS
    assert d("statetier_operations_total", tier="host", kind="kv", op="load") == 2
    assert d("statetier_misses_total", kind="kv") == 1
    assert d("statetier_misses_total", kind="ssm") == 1
    assert d("statetier_rejections_total", reason="stale") == 2
    assert d("statetier_rejections_total", reason="fingerprint") == 1
    assert d("statetier_errors_total", reason="stale") == 2
    assert d("statetier_errors_total", reason="fingerprint") == 1
    assert d("statetier_errors_total", reason="not_found") == 2
    assert d("statetier_lookup_hit_tokens_count") == 2
    assert d("statetier_lookup_hit_tokens_sum") == 64
    assert d("statetier_auth_failures_total", reason="token") == 0


async def test_a_refused_load_is_no_hit_and_lookups_count_requested_and_restored_tokens(daemon) -> None:
    spec = jamba_namespace("metrics-refused", block=16)
    tokens = list(range(64))
    async with AsyncClient(daemon.url, namespace=spec) as client:
        refs = [await client.put_kv(layer, prefix_hash(tokens[:32], block_size=16), 0, 32, kv_page(layer, 32),
                                    request_id="refused") for layer in range(3)]
        before = daemon.scrape()
        for ref in refs:  # a consumer that expects pages of another shape: every load refused
            with pytest.raises(DestinationMismatch):
                await client.load(ref, expect={"kv": ("bfloat16", (2, 8, 64, 128))})
        after = daemon.scrape()
        # the request was wrong, not the stored bytes: an error, never a rejection
        assert after.delta(before, "statetier_rejections_total", reason="corrupt_payload") == 0
        assert after.delta(before, "statetier_errors_total", reason="destination_mismatch") == 3
        assert sum(after.matching("statetier_hits_total").values()) == sum(before.matching("statetier_hits_total").values())
        found = await client.lookup([0, 1, 2], [], token_ids=tokens, kv_layout="prefix", lease=False)
        assert found.tokens == 32
    counted = daemon.scrape()
    assert counted.delta(after, "statetier_lookup_requested_tokens_total") == 64
    assert counted.delta(after, "statetier_lookup_restored_tokens_total") == 32


async def test_gauges_equal_what_stats_reports(daemon) -> None:
    async with AsyncClient(daemon.url, namespace=jamba_namespace("metrics-gauges")) as client:
        ref = await client.put_kv(0, bytes(32), 0, 64, kv_page(0, 64), request_id="g")
        found = await client.lookup([0], [], [(64, bytes(32))], kv_layout="prefix")

        async def settled():  # no write-behind copy moved between two STATS: the scrape between holds
            stats = await client.stats()
            samples = daemon.scrape()
            if (await client.stats())["tiers"] == stats["tiers"] and stats["write_behind_pending"] == 0:
                return stats, samples
            return None

        stats, samples = await eventually(settled, "the tiers settled")
        for tier in stats["tiers"]:
            name = tier["tier"]
            assert samples.value("statetier_tier_used_bytes", tier=name) == tier["bytes_used"], name
            assert samples.value("statetier_tier_capacity_bytes", tier=name) == tier["capacity"], name
            assert samples.value("statetier_tier_objects", tier=name) == tier["objects"], name
            assert samples.value("statetier_leases", tier=name) == tier["leases"], name
        assert samples.value("statetier_client_leases") == stats["leases"] == 1
        assert samples.value("statetier_connections") == stats["daemon"]["connections"] == 1
        await client.release(found.lease_ids)
        assert daemon.scrape().value("statetier_client_leases") == 0
        assert await client.delete(ref) >= 1


def test_health_and_readiness_endpoints(daemon) -> None:
    assert daemon.http_get("/healthz") == (200, b"ok\n")
    assert daemon.http_get("/readyz") == (200, b"ready\n")
    assert daemon.http_get("/nope")[0] == 404
