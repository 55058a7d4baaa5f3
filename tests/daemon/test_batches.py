"""The batch is the engine's unit of work (issue 21, item 1): counted, not timed.

A batch of 64 puts of 64 KiB from a connection's put window makes one registry call (its
version claims) and one executor job (every copy into the arena and every digest); a batch
of 64 loads by ref makes one registry call and no executor job (the arena's copies need no
digest in the daemon; the client verifies where the bytes land); through a real server and
SDK, the load batch's window copies are one job too. A single put is a batch of one through
the same code: below ``INLINE_WORK_BYTES`` no job at all. A stale item ends its batch: the
items before it are stored, nothing after it is claimed; a batch that fails after claiming
withdraws its claims, so the versions stored before stay current.
"""

from __future__ import annotations

import collections
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from statetier.clients import AsyncClient, PutItem
from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.requests import Incoming, LoadRequest, PutRequest, PutResult
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import QuotaExceeded, StaleState
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import header_length
from statetier.protocol.thresholds import INLINE_WORK_BYTES
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.registry import MemoryVersionRegistry
from tests.support.server_harness import running_daemon

NS_SPEC = NamespaceSpec("batch-unit")
NS = NS_SPEC.namespace()
KV = (TensorSpec("kv", "bfloat16", (2, 8, 16, 128)),)  # 64 KiB
ITEM = 64 * 1024


class CountingRegistry(MemoryVersionRegistry):
    """The real in-memory registry, counting its calls by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __getattribute__(self, name: str):
        if name in ("claim", "claim_many", "withdraw", "newest", "newest_many", "stream_of", "read_many"):
            object.__getattribute__(self, "calls")[name] += 1
        return object.__getattribute__(self, name)


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(2)
        self.jobs = 0

    def submit(self, *args, **kwargs):
        self.jobs += 1
        return super().submit(*args, **kwargs)


@pytest.fixture
async def counted():
    registry, executor = CountingRegistry(), CountingExecutor()
    host = HostTier(HostTierOptions(64 << 20))
    engine = Engine([host], keyring=Keyring.generate(), registry=registry, options=EngineOptions(producer_id="t"),
                    arena=host, executor=executor)
    await engine.start()
    yield engine, registry, executor
    await engine.close()
    executor.shutdown()


def key(layer: int) -> StateKey:
    return StateKey(NS, Kind.KV, layer, os.urandom(32), 0, 16)


def window_items(count: int, window: memoryview, request: str = "r", version=None) -> list[Incoming]:
    return [Incoming(PutRequest("default", key(i), Provenance(request), KV, version=version),
                     window[i * ITEM : (i + 1) * ITEM], shared=True) for i in range(count)]


async def test_a_batch_of_64_puts_and_loads_makes_one_registry_call_and_one_executor_job(counted):
    engine, registry, executor = counted
    window = memoryview(bytearray(os.urandom(64 * ITEM)))  # a put window its client still writes
    registry.calls.clear()
    results = await engine.put_batch(window_items(64, window))
    assert all(isinstance(r, PutResult) for r in results)
    assert registry.calls == {"claim_many": 1} and executor.jobs == 1

    registry.calls.clear()
    executor.jobs = 0
    loaded = await engine.load_batch([LoadRequest("default", NS, ref=r.ref) for r in results], owner="c")
    assert [bytes(result.payload) for result in loaded] == [bytes(window[i * ITEM : (i + 1) * ITEM])
                                                            for i in range(64)]
    assert registry.calls == {"read_many": 1} and executor.jobs == 0
    assert await engine.release_many([result.lease_id for result in loaded], "c") == 64


async def test_a_single_put_is_a_batch_of_one_and_small_work_stays_on_the_loop(counted):
    engine, registry, executor = counted
    registry.calls.clear()
    put = await engine.put(PutRequest("default", key(1), Provenance("one"), KV), os.urandom(ITEM))
    assert registry.calls == {"claim_many": 1} and executor.jobs == 0  # 64 KiB < INLINE_WORK_BYTES
    big = (TensorSpec("kv", "uint8", (INLINE_WORK_BYTES,)),)
    await engine.put(PutRequest("default", key(2), Provenance("one"), big), os.urandom(INLINE_WORK_BYTES))
    assert executor.jobs == 1
    loaded = await engine.load(LoadRequest("default", NS, ref=put.ref), owner="c")
    assert loaded.header.ref() == put.ref


async def test_a_stale_item_ends_its_batch_and_nothing_after_it_is_claimed(counted):
    engine, registry, _ = counted
    window = memoryview(bytearray(os.urandom(3 * ITEM)))
    first = window_items(3, window, request="stale")
    stored = await engine.put_batch(first)
    again = [Incoming(PutRequest("default", item.req.key, Provenance("stale"), KV, version=version), item.payload,
                      shared=True) for item, version in zip(first, (5, 1, 5))]  # 1 is not newer than 1
    answers = await engine.put_batch(again)
    assert isinstance(answers[0], PutResult) and answers[0].ref.version == 5
    assert isinstance(answers[1], StaleState) and answers[2] is None
    third = stored[2].ref.stream_id
    assert (await registry.newest(third)).state_id == stored[2].ref.state_id  # never claimed by the batch
    loaded = await engine.load(LoadRequest("default", NS, ref=stored[2].ref), owner="c")  # still current
    assert loaded.header.version == 1


async def test_a_batch_that_fails_after_claiming_withdraws_its_claims():
    registry, host, keyring = CountingRegistry(), HostTier(HostTierOptions(64 << 20)), Keyring.generate()
    small = (TensorSpec("kv", "uint8", (4096,)),)
    keys = [key(i) for i in range(2)]
    size = header_length(keys[0], Provenance("w"), small, keyring.active.alg) + 4096
    engine = Engine([host], keyring=keyring, registry=registry, arena=host,
                    options=EngineOptions(quotas={"capped": {"host": 3 * size}}))
    await engine.start()
    try:
        first = [await engine.put(PutRequest("capped", k, Provenance("w"), small), os.urandom(4096)) for k in keys]
        answers = await engine.put_batch([  # the batch's first item takes the last room of the quota
            Incoming(PutRequest("capped", k, Provenance("w"), small), memoryview(os.urandom(4096))) for k in keys])
        assert isinstance(answers[0], PutResult) and answers[0].ref.version == 2
        assert isinstance(answers[1], QuotaExceeded)
        head = await registry.newest(first[1].ref.stream_id)
        assert (head.version, head.state_id) == (1, first[1].ref.state_id)  # the failed claim was withdrawn
        loaded = await engine.load(LoadRequest("capped", NS, ref=first[1].ref), owner="c")
        assert loaded.header.version == 1  # still current, not superseded by a claim never stored
    finally:
        await engine.close()


async def test_through_the_server_a_put_batch_is_one_job_and_a_load_batch_copies_on_the_loop(tmp_path):
    executor = CountingExecutor()
    try:
        async with running_daemon(arena=True, executor=executor) as daemon:
            async with AsyncClient(f"unix://{daemon.config.listen.socket_path}", namespace=NS_SPEC) as client:
                assert client.uses_shm
                pages = [{"kv": torch.randn(2, 8, 16, 128).to(torch.bfloat16)} for _ in range(64)]
                items = [PutItem(client.kv_key(i, os.urandom(32), 0, 16), page, request_id="srv")
                         for i, page in enumerate(pages)]
                executor.jobs = 0
                refs = await client.put_many(items)
                assert executor.jobs == 1  # one PUT_BATCH frame: one copy-and-seal job
                executor.jobs = 0
                loaded = await client.load_many(refs, concurrency=1)
                assert executor.jobs == 0  # one LOAD_BATCH frame: its 64 window copies digest nothing
                assert all(torch.equal(got["kv"], want["kv"]) for got, want in zip(loaded, pages))
    finally:
        executor.shutdown()


async def test_through_the_server_a_batch_of_64_is_one_metric_update_per_kind_and_op(tmp_path):
    async with running_daemon(arena=True) as daemon:
        updates = []
        observe_ops = daemon.metrics.observe_ops

        def counted(tier, kind, op, count, nbytes, seconds):
            updates.append((tier, kind, op, count))
            observe_ops(tier, kind, op, count, nbytes, seconds)

        daemon.metrics.observe_ops = counted
        async with AsyncClient(f"unix://{daemon.config.listen.socket_path}", namespace=NS_SPEC) as client:
            pages = [{"kv": torch.randn(2, 8, 16, 128).to(torch.bfloat16)} for _ in range(64)]
            items = [PutItem(client.kv_key(i, os.urandom(32), 0, 16), page, request_id="m")
                     for i, page in enumerate(pages)]
            updates.clear()
            refs = await client.put_many(items)
            counted_ops = [u for u in updates if u[0] == "daemon" and u[2] != "release"]
            assert counted_ops == [("daemon", "kv", "put", 64)]  # one update, not one per item
            updates.clear()
            await client.load_many(refs, concurrency=1)
            # (a RELEASE giving the load window's regions back may be counted beside it)
            assert [u for u in updates if u[0] == "daemon" and u[2] != "release"] == [("daemon", "kv", "load", 64)]
