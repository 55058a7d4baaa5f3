"""End to end: clearing a model's state (issue 27 item 4), and seeing what is stored (item 8).

A daemon subprocess with host, disk and a real redis-server; two tenants by token on its
Unix socket, this process not an operator unless a test says so.

- ``purge`` of one namespace removes every copy of its objects from the host arena, the disk
  tier and Redis (their keys are gone from the redis-server), counts them in the reply and in
  ``statetier_purged_objects_total{tier}``, and leaves the other namespace untouched; after a
  restart the purged objects stay gone. ``list_objects`` shows both namespaces before (objects,
  bytes, copies per tier, kinds, times) and only the other after.
- Tenant-checked: tenant B can neither purge A's namespace (naming it names a namespace of
  B's own) nor A's tenant; an operator (``listen.operator_uids``) purges a whole tenant and
  lists every tenant, and its own client's ``purge()`` (or ``purge(spec)``) its own namespace.
- Concurrent loads: loads of the namespace's objects racing the purge each return the exact
  tensors or ``NotFound``; no lease is violated and nothing of the namespace is left.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from statetier.clients import AsyncClient, Client
from statetier.daemon.server.auth import token_sha256
from statetier.protocol.errors import Forbidden, NotFound
from statetier.protocol.ownership import owned_namespace
from statetier.tiers.redis.layout import RedisKeys
from tests.support.daemons import daemon_fixture
from tests.support.jamba import assert_same_tensors, jamba_namespace, kv_page, snapshot

TOKENS = {"a": "tenant-a-purge-token", "b": "tenant-b-purge-token"}
TENANTS = [{"name": name, "token_sha256": token_sha256(token)} for name, token in TOKENS.items()]
KEYS = RedisKeys("st")


def tenant_client(daemon, tenant: str, spec, **options) -> Client:
    return Client(daemon.url, namespace=spec, tenant=tenant, token=TOKENS[tenant], **options)


@pytest.fixture
def daemon(request, fresh_redis):
    # this process's uid is no operator here: operator_uids names another uid
    return daemon_fixture(request, name="purge", redis_url=fresh_redis.url,
                          config={"tenants": TENANTS, "listen": {"operator_uids": [65534]}})


def put_some(client: Client, count: int, seed: int) -> list:
    refs = []
    for i in range(count):
        refs.append(client.put_ssm(i, bytes([seed, i]) * 16, 64, snapshot(seed * 100 + i), request_id="r",
                                   publish=True, durable=True))
        refs.append(client.put_kv(i, bytes([seed, i]) * 16, 0, 64, kv_page(seed * 100 + i, 64), request_id="r",
                                  publish=True, durable=True))
    return refs


def in_redis(fresh_redis, refs) -> int:
    with fresh_redis.client() as redis_client:
        return sum(redis_client.exists(KEYS.manifest(ref.state_id)) for ref in refs)


def test_a_purged_namespace_leaves_every_tier_and_the_other_stays(daemon, fresh_redis) -> None:
    model, other = jamba_namespace("purge-me"), jamba_namespace("keep-me")
    with tenant_client(daemon, "a", model) as client:
        purged = put_some(client, 4, seed=1)
    with tenant_client(daemon, "a", other) as client:
        kept = put_some(client, 2, seed=2)
    with tenant_client(daemon, "a", model) as client:
        before = {row["namespace"]: row for row in client.list_objects()["namespaces"]}
        row = before[owned_namespace("a", model.namespace()).hex()]  # listed as stored: tenant a's own
        assert (row["tenant"], row["objects"], row["kinds"]) == ("a", 8, {"ssm": 4, "kv": 4})
        assert {tier: on["objects"] for tier, on in row["tiers"].items()} == {"host": 8, "disk": 8, "redis": 8}
        assert row["bytes"] == sum(on["bytes"] for on in row["tiers"].values()) // 3
        assert row["oldest_ns"] <= row["newest_ns"] and before[owned_namespace("a", other.namespace()).hex()]["objects"] == 4
        assert in_redis(fresh_redis, purged) == 8

        metrics_before = daemon.scrape()
        report = client.purge()
        assert (report["objects"], report["copies"], report["namespaces"]) == (8, 24, 1)
        assert report["by_tier"] == {"host": 8, "disk": 8, "redis": 8} and report["unavailable"] == []
        after = daemon.scrape()
        assert {tier: after.delta(metrics_before, "statetier_purged_objects_total", tier=tier)
                for tier in ("host", "disk", "redis")} == {"host": 8, "disk": 8, "redis": 8}
        assert in_redis(fresh_redis, purged) == 0
        for ref in purged:
            with pytest.raises(NotFound):
                client.load(ref)
        assert [row["namespace"] for row in client.list_objects()["namespaces"]] == [owned_namespace("a", other.namespace()).hex()]
    assert in_redis(fresh_redis, kept) == 4
    daemon.restart()
    with tenant_client(daemon, "a", other) as client:
        for index, ref in enumerate(kept):
            want = snapshot(200 + index // 2) if index % 2 == 0 else kv_page(200 + index // 2, 64)
            assert_same_tensors(client.load(ref), want)
    with tenant_client(daemon, "a", model) as client:
        for ref in purged:
            with pytest.raises(NotFound):
                client.load(ref)


def test_purge_is_tenant_checked_and_an_operator_purges_a_whole_tenant(request, fresh_redis) -> None:
    daemon = daemon_fixture(request, name="purge-op", redis_url=fresh_redis.url,
                            config={"tenants": TENANTS, "listen": {"operator_uids": [os.getuid()]}})
    spec = jamba_namespace("tenant-a-model")
    with tenant_client(daemon, "a", spec) as client:
        refs = put_some(client, 2, seed=3)
    with tenant_client(daemon, "b", jamba_namespace("tenant-b-model")) as client:
        put_some(client, 1, seed=4)
        assert [row["tenant"] for row in client.list_objects()["namespaces"]] == ["b"]
        everyone = client.list_objects(all_tenants=True)["namespaces"]  # this uid is an operator here
        assert sorted(row["tenant"] for row in everyone) == ["a", "b"]
        report = client.purge(tenant="a")
    assert report["objects"] == 4 and in_redis(fresh_redis, refs) == 0
    with tenant_client(daemon, "b", jamba_namespace("tenant-b-model")) as client:
        assert [row["tenant"] for row in client.list_objects(all_tenants=True)["namespaces"]] == ["b"]


def test_an_operators_client_purges_its_own_namespace_by_default_and_by_spec(request, fresh_redis) -> None:
    daemon = daemon_fixture(request, name="purge-own-op", redis_url=fresh_redis.url,
                            config={"tenants": TENANTS, "listen": {"operator_uids": [os.getuid()]}})
    default, named = jamba_namespace("operator-default"), jamba_namespace("operator-named")
    with tenant_client(daemon, "a", named) as client:
        by_spec = put_some(client, 1, seed=6)
    with tenant_client(daemon, "a", default) as client:
        by_default = put_some(client, 1, seed=7)
        # an operator's daemon takes the digest it is given as it is: the SDK sends the owned one
        assert client.purge()["objects"] == 2
        assert client.purge(named)["objects"] == 2
        assert client.list_objects()["namespaces"] == []
    assert in_redis(fresh_redis, by_spec + by_default) == 0


def test_a_tenant_may_not_purge_or_list_another_tenant(daemon, fresh_redis) -> None:
    spec = jamba_namespace("tenant-a-private")
    with tenant_client(daemon, "a", spec) as client:
        refs = put_some(client, 1, seed=5)
    with tenant_client(daemon, "b", jamba_namespace("tenant-b-own")) as client:
        # A's spec, or even A's stored namespace, names a namespace of B's own: nothing of A's goes
        assert client.purge(spec)["objects"] == 0
        assert client.purge(owned_namespace("a", spec.namespace()))["objects"] == 0
        with pytest.raises(Forbidden):
            client.purge(tenant="a")
        with pytest.raises(Forbidden):
            client.list_objects(all_tenants=True)
        assert client.list_objects()["namespaces"] == []
    assert in_redis(fresh_redis, refs) == 2
    daemon.restart()  # who owns a namespace is in its digest: the same after a restart
    with tenant_client(daemon, "b", spec) as client:
        assert client.purge(spec)["objects"] == 0
    assert in_redis(fresh_redis, refs) == 2
    with tenant_client(daemon, "a", spec) as client:
        client.load(refs[0])  # the refused purge claimed nothing: A still uses its namespace
        assert client.purge(tenant="a")["objects"] == 2  # its own tenant, without being an operator


async def test_loads_racing_a_purge_get_their_exact_bytes_or_not_found(daemon, fresh_redis) -> None:
    spec = jamba_namespace("purge-race")
    async with AsyncClient(daemon.url, namespace=spec, tenant="a", token=TOKENS["a"]) as client:
        pages = {i: kv_page(500 + i, 256) for i in range(16)}
        refs = {i: await client.put_kv(i, bytes([i]) * 32, 0, 256, pages[i], request_id="race", publish=True)
                for i in pages}

        async def load_forever(i: int) -> list[str]:
            seen = []
            for _ in range(20):
                try:
                    assert_same_tensors(await client.load(refs[i]), pages[i])
                    seen.append("exact")
                except NotFound:
                    seen.append("not_found")
            return seen

        loads = [asyncio.create_task(load_forever(i)) for i in pages]
        await asyncio.sleep(0)
        report = await client.purge()
        outcomes = [outcome for seen in await asyncio.gather(*loads) for outcome in seen]
    assert set(outcomes) <= {"exact", "not_found"} and outcomes[-1] == "not_found"
    assert report["objects"] == 16
    assert all(value == 0 for value in daemon.scrape().matching("statetier_lease_violations_total").values())
    assert in_redis(fresh_redis, refs.values()) == 0
    async with AsyncClient(daemon.url, namespace=spec, tenant="a", token=TOKENS["a"]) as client:
        assert (await client.list_objects())["namespaces"] == []
