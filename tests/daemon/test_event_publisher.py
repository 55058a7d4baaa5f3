"""daemon.events.EventPublisher with real ZMQ sockets (ipc) and vLLM's schema on the other end.

What a loop iteration's events become: one batch per stream and topic (the namespace's), equal
neighbours one event, at most ``MAX_BATCH_EVENTS`` a batch; each tenant's events on its own
socket only; the start's ``AllBlocksCleared`` first in the ring; an address in use refused at
start with ``ConfigError``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from statetier.daemon.config_events import EventsConfig
from statetier.daemon.events import EventPublisher
from statetier.daemon.events.publisher import MAX_BATCH_EVENTS
from statetier.protocol.errors import ConfigError
from statetier.protocol.kv_events import BlockRemoved, BlockStored
from tests.support import kv_event_schema as vllm
from tests.support.folders import short_folder
from tests.support.waiting import eventually

NS_1, NS_2 = b"\x01" * 32, b"\x02" * 32


def stored(n: int, medium: str = "CPU") -> BlockStored:
    return BlockStored((n,), None, (), 16, medium)


@pytest.fixture
def folder():
    with short_folder("st-ev-") as made:
        yield made


def publisher_for(folder: Path, tenants=("a", "b")) -> EventPublisher:
    config = EventsConfig(enabled=True, endpoint=f"ipc://{folder}/ev-{{tenant}}",
                          replay_endpoint=f"ipc://{folder}/replay-{{tenant}}")
    return EventPublisher(config.streams(list(tenants)))


async def listening(publisher: EventPublisher, *subscribers: vllm.Subscriber) -> None:
    await eventually(lambda: publisher.stats()["subscriptions"] >= len(subscribers),
                     "the subscriptions reached the publisher")


async def test_one_loop_iteration_is_one_batch_per_topic_with_equal_neighbours_merged(folder):
    publisher = publisher_for(folder)
    publisher.start()
    one = vllm.Subscriber(f"ipc://{folder}/ev-a", topic=NS_1.hex().encode())
    every = vllm.Subscriber(f"ipc://{folder}/ev-a")
    try:
        await listening(publisher, one, every)
        for event in (stored(1), stored(1), BlockRemoved((1,), "CPU"), stored(1)):
            publisher.emit("a", NS_1, event)
        publisher.emit("a", NS_2, stored(2))
        publisher.emit("nobody", NS_1, stored(3))  # a tenant without a stream
        await asyncio.sleep(0)
        got = await asyncio.to_thread(every.take, 2)
        assert [(topic, [type(e).__name__ for e in batch.events]) for topic, _, batch in got] == [
            (NS_1.hex().encode(), ["BlockStored", "BlockRemoved", "BlockStored"]),
            (NS_2.hex().encode(), ["BlockStored"])]
        assert [(topic, seq) for topic, seq, _ in await asyncio.to_thread(one.take, 1)] == [(NS_1.hex().encode(),
                                                                                            got[0][1])]
        assert every.drain(0.2) == [] and one.drain(0.2) == []
        # the four, and the start's AllBlocksCleared on each of the two streams
        assert publisher.stats() == {"published": 6, "dropped": 0, "overflows": 0, "subscriptions": 2}
    finally:
        one.close()
        every.close()
        publisher.close()


async def test_a_long_iteration_is_cut_into_batches_of_max_batch_events(folder):
    publisher = publisher_for(folder, ("a",))
    publisher.start()
    every = vllm.Subscriber(f"ipc://{folder}/ev-a")
    try:
        await listening(publisher, every)
        for n in range(MAX_BATCH_EVENTS + 3):
            publisher.emit("a", NS_1, stored(n))
        await asyncio.sleep(0)
        got = await asyncio.to_thread(every.take, 2)
        assert [len(batch.events) for _, _, batch in got] == [MAX_BATCH_EVENTS, 3]
        assert [e.block_hashes[0] for _, _, b in got for e in b.events] == list(range(MAX_BATCH_EVENTS + 3))
    finally:
        every.close()
        publisher.close()


async def test_each_tenant_hears_only_its_own_events_and_the_ring_starts_with_a_clear(folder):
    publisher = publisher_for(folder)
    publisher.start()
    a, b = vllm.Subscriber(f"ipc://{folder}/ev-a"), vllm.Subscriber(f"ipc://{folder}/ev-b")
    try:
        await listening(publisher, a, b)
        publisher.emit("a", NS_1, stored(1))
        publisher.emit("b", NS_2, stored(2, "DISK"))
        await asyncio.sleep(0)
        (_, _, got_a), = await asyncio.to_thread(a.take, 1)
        (_, _, got_b), = await asyncio.to_thread(b.take, 1)
        assert [e.block_hashes for e in got_a.events] == [[1]] and [e.block_hashes for e in got_b.events] == [[2]]
        assert a.drain(0.2) == [] and b.drain(0.2) == []
        replayed = await asyncio.to_thread(a.replay, f"ipc://{folder}/replay-a", 0)
        assert [(seq, type(batch.events[0]).__name__) for _, seq, batch in replayed] == [
            (0, "AllBlocksCleared"), (1, "BlockStored")]
        assert replayed[0][0] == b""  # the start's clear names no namespace
    finally:
        a.close()
        b.close()
        publisher.close()


async def test_an_address_in_use_is_refused_at_start(folder):
    first = publisher_for(folder, ("a",))
    first.start()
    second = publisher_for(folder, ("a",))
    try:
        with pytest.raises(ConfigError, match="cannot bind"):
            second.start()
    finally:
        second.close()
        first.close()


def test_two_tenants_on_one_address_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"events\.endpoint: tenants 'a' and 'b' would share"):
        EventsConfig(enabled=True).streams(["a", "b"])
    with pytest.raises(ValueError, match=r"events\.endpoints: 'c' is not a configured tenant"):
        EventsConfig(enabled=True, endpoints={"c": "tcp://127.0.0.1:1"}).streams(["a"])
    specs = EventsConfig(enabled=True, endpoints={"b": "tcp://127.0.0.1:5600"}).streams(["a", "b"])
    assert [(s.tenant, s.endpoint) for s in specs] == [("a", "tcp://127.0.0.1:5557"), ("b", "tcp://127.0.0.1:5600")]
