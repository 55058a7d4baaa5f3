"""End to end, daemon in a subprocess: the KV event streams a router reads (issue 26).

A real ZMQ SUB socket decodes each tenant's stream with the Structs of vLLM's published schema
(``kv_event_schema.py``, not the daemon's encoder):

- tenant A's puts (one published), the write-behind copies (the published one's too), an eviction from the host arena
  (a 1 MiB arena that holds three pages), a delete, and at the end a purge of the namespace:
  per medium (``CPU``, ``DISK``, ``REDIS``) exactly those events, in order, naming the blocks
  by the tags A's client attached; a subscriber of A's namespace topic sees the same, and
  nothing of A's other namespace (the topic A's client names, ``events_topic()``: the
  namespace the daemon owns for A, as refs carry it, not the one A's spec names);
- tenant B's stream, on its own socket, carries B's events and none of A's (and when B's put
  evicts A's page from the shared arena, that is on A's stream, not B's);
- the replay socket answers the batches from a sequence number on, as vLLM's does;
- a subscriber that never reads: every put is answered, another subscriber gets every batch,
  its overflow is counted (``statetier_event_overflows_total``) and, once it reads again, it
  sees the gap in the sequence numbers and replays it from the ring.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import zmq

from statetier.clients import AsyncClient, BlockTag
from statetier.daemon.server.auth import token_sha256
from statetier.protocol.errors import InvalidRequest, NotFound
from statetier.protocol.identity import NamespaceSpec
from statetier.protocol.ownership import owned_namespace
from tests.support.daemons import daemon_fixture
from tests.support.kv_event_schema import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber
from tests.support.waiting import eventually

TOKENS = {"a": "tenant-a-events-token", "b": "tenant-b-events-token"}
TOKENS_PER_PAGE = 64
PAGE_SHAPE = (2, 8, TOKENS_PER_PAGE, 128)  # 256 KiB of bfloat16: the 1 MiB arena holds three


@pytest.fixture(scope="module")
def daemon(request):
    from statetier.launch import RedisServer

    redis = RedisServer().start()
    request.addfinalizer(redis.stop)
    tenants = [{"name": name, "token_sha256": token_sha256(token)} for name, token in TOKENS.items()]
    config = {"tenants": tenants + [{"name": "default"}],
              "host": {"high_watermark": 0.9, "low_watermark": 0.85},
              "events": {"enabled": True, "endpoint": "ipc://ev-{tenant}", "replay_endpoint": "ipc://replay-{tenant}"}}
    return daemon_fixture(request, name="events", config=config, host_capacity="1MiB", redis_url=redis.url)


def stream(daemon, tenant: str) -> str:
    return f"ipc://{daemon.directory}/ev-{tenant}"


def replay_socket(daemon, tenant: str) -> str:
    return f"ipc://{daemon.directory}/replay-{tenant}"


async def subscribed(daemon, count: int) -> None:
    """Wait until the daemon counts ``count`` subscriptions: a SUB socket's subscription
    travels to the publisher after ``connect``, and what is sent before it arrives is not its."""
    await eventually(lambda: _at_least(daemon, count))


async def _at_least(daemon, count: int) -> bool:
    samples = await asyncio.to_thread(daemon.scrape)
    return samples.value("statetier_event_subscribers") >= count


def page(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(*PAGE_SHAPE, generator=gen).to(torch.bfloat16)}


def tag(n: int) -> BlockTag:
    """The engine's name of block ``n``: a 32-byte hash, its parent's, its tokens."""
    return BlockTag(bytes([n]) * 32, bytes([n - 1]) * 32 if n > 1 else None,
                    tuple(range(n * 1000, n * 1000 + TOKENS_PER_PAGE)))


def per_medium(messages) -> dict[str, list[tuple[str, bytes]]]:
    """Every block event of the messages, as (type, first block hash), by medium, in order."""
    found: dict[str, list] = {}
    for _, _, batch in messages:
        for event in batch.events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                assert len(event.block_hashes) == 1
                found.setdefault(event.medium, []).append((type(event).__name__, event.block_hashes[0]))
    return found


async def put_page(client: AsyncClient, n: int, *, publish: bool = False):
    key = client.kv_key(0, bytes([n]) * 32, 0, TOKENS_PER_PAGE)
    return await client.put(key, page(n), request_id=f"r{n}", publish=publish, tag=tag(n))


def hashes(*ns: int) -> list[bytes]:
    return [bytes([n]) * 32 for n in ns]


async def test_a_router_sees_puts_write_behind_eviction_delete_and_purge_per_medium_and_no_other_tenants(daemon):
    a_all = Subscriber(stream(daemon, "a"))
    spec_a = NamespaceSpec(model_id="events-a", kv_block_size=TOKENS_PER_PAGE)
    b_all = Subscriber(stream(daemon, "b"))
    a_topic = None
    try:
        async with AsyncClient(daemon.url, namespace=spec_a, tenant="a", token=TOKENS["a"]) as a:
            topic = a.events_topic().encode()
            assert topic == owned_namespace("a", spec_a.namespace()).hex().encode() != spec_a.namespace().hex().encode()
            async with AsyncClient(daemon.url, namespace=spec_a, token=TOKENS["a"]) as by_token:  # tenant "default"
                assert by_token.events_topic().encode() == topic  # the tenant the daemon admitted, not the one named
            a_topic = Subscriber(stream(daemon, "a"), topic=topic)
            await subscribed(daemon, 3)
            stored = [await put_page(a, 1), await put_page(a, 2, publish=True), await put_page(a, 3)]
            assert {ref.key.namespace for ref in stored} == {a.owned_namespace}
            # write-behind copies 1, 2 and 3 to disk (2, published, is in Redis too: issue 35)
            seen = a_all.take(1)
            seen += await asyncio.to_thread(_until, a_all, seen, lambda m: m.get("DISK", []) == [
                ("BlockStored", h) for h in hashes(1, 2, 3)])
            await put_page(a, 4)  # the arena is full: page 1, held on disk already, leaves it
            seen += await asyncio.to_thread(_until, a_all, seen, lambda m: len(m.get("DISK", [])) == 4)
            await a.delete(stored[2])
            seen += await asyncio.to_thread(_until, a_all, seen, lambda m: len(m.get("DISK", [])) == 5)
            other = NamespaceSpec(model_id="events-a-other", kv_block_size=TOKENS_PER_PAGE)
            async with AsyncClient(daemon.url, namespace=other, tenant="a", token=TOKENS["a"]) as a2:
                await put_page(a2, 9)
        seen += a_all.drain()
        assert per_medium(seen) == {
            "CPU": [("BlockStored", h) for h in hashes(1, 2, 3)] + [("BlockRemoved", hashes(1)[0]),
                                                                   ("BlockStored", hashes(4)[0]),
                                                                   ("BlockRemoved", hashes(3)[0]),
                                                                   ("BlockStored", hashes(9)[0])],
            "REDIS": [("BlockStored", hashes(2)[0])],
            "DISK": [("BlockStored", h) for h in hashes(1, 2, 3)] + [("BlockStored", hashes(4)[0]),
                                                                 ("BlockRemoved", hashes(3)[0]),
                                                                 ("BlockStored", hashes(9)[0])],
        }
        first_store = next(e for _, _, b in seen for e in b.events if isinstance(e, BlockStored))
        assert (first_store.parent_block_hash, first_store.token_ids, first_store.block_size, first_store.lora_id) \
            == (None, list(range(1000, 1064)), TOKENS_PER_PAGE, None)
        seqs = [seq for _, seq, _ in seen]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap

        # the namespace's topic carries the same events and none of the other namespace's
        mine = a_topic.drain()
        assert {got for got, _, _ in mine} == {topic}
        assert per_medium(mine) == {medium: [e for e in events if e[1] != hashes(9)[0]]
                                    for medium, events in per_medium(seen).items()}

        # B's stream: B's own put, and nothing of A's
        spec_b = NamespaceSpec(model_id="events-b", kv_block_size=TOKENS_PER_PAGE)
        async with AsyncClient(daemon.url, namespace=spec_b, tenant="b", token=TOKENS["b"]) as b:
            await put_page(b, 7)
        b_seen = b_all.take(1) + b_all.drain()
        assert per_medium(b_seen) == {"CPU": [("BlockStored", hashes(7)[0])], "DISK": [("BlockStored", hashes(7)[0])]}
        # B's page took the arena's room: A's page 2 (held in Redis) left it, on A's stream
        evicted = a_all.take(1) + a_all.drain()
        assert per_medium(evicted) == {"CPU": [("BlockRemoved", hashes(2)[0])]}
        seen += evicted

        # A clears its namespace (a purge): every copy left goes, on every medium, and nothing else
        async with AsyncClient(daemon.url, namespace=spec_a, tenant="a", token=TOKENS["a"]) as a:
            purged = await a.purge()
        assert purged["objects"] == 3 and purged["copies"] == 5
        cleared = a_all.take(1) + a_all.drain()
        assert {medium: sorted(events) for medium, events in per_medium(cleared).items()} == {
            "CPU": [("BlockRemoved", hashes(4)[0])],
            "DISK": sorted(("BlockRemoved", h) for h in hashes(1, 2, 4)),
            "REDIS": [("BlockRemoved", hashes(2)[0])]}  # in the purge's order within a medium
        seen += cleared
        assert b_all.drain() == []

        # the replay socket answers from a sequence number on: the start's AllBlocksCleared first
        replayed = a_all.replay(replay_socket(daemon, "a"), 0)
        assert isinstance(replayed[0][2].events[0], AllBlocksCleared)
        assert [seq for _, seq, _ in replayed] == list(range(len(replayed)))
        assert per_medium(replayed) == per_medium(seen)
    finally:
        for subscriber in (a_all, a_topic, b_all):
            if subscriber is not None:
                subscriber.close()


def _until(subscriber: Subscriber, seen: list, done, timeout: float = 20.0) -> list:
    """Messages until ``done(per_medium(seen + new))``."""
    new: list = []
    while not done(per_medium(seen + new)):
        new += subscriber.take(1, timeout)
    return new


@pytest.fixture(scope="module")
def crowded(request):
    """A daemon whose stream lets one message wait per subscriber, with no disk tier (so every
    put is exactly one event) and the replay ring large enough for the whole test."""
    config = {"disk": {"enabled": False},
              "events": {"enabled": True, "endpoint": "ipc://ev", "replay_endpoint": "ipc://replay", "hwm": 1}}
    return daemon_fixture(request, name="crowded", config=config)


PUTS = 300
BIG_TAG_TOKENS = 16384  # ~48 KB per event: the sockets' kernel buffers fill after a few


async def test_a_subscriber_that_never_reads_slows_no_put_nor_other_subscribers_and_replays_what_it_missed(crowded):
    url = f"ipc://{crowded.directory}/ev"
    stuck = Subscriber(url)
    stuck.socket.setsockopt(zmq.RCVHWM, 1)
    reader = Subscriber(url)
    try:
        await subscribed(crowded, 2)
        before = await asyncio.to_thread(crowded.scrape)
        spec = NamespaceSpec(model_id="events-crowded", kv_block_size=16)
        tokens = tuple(range(BIG_TAG_TOKENS))
        read: list = []
        async with AsyncClient(crowded.url, namespace=spec) as client:
            for n in range(PUTS):  # the reader keeps up (one message behind at most); ``stuck`` reads nothing
                key = client.kv_key(0, n.to_bytes(32, "big"), 0, BIG_TAG_TOKENS)
                await client.put(key, {"kv": torch.zeros(16, 8)}, request_id=f"r{n}",
                                 tag=BlockTag(n, n - 1 if n else None, tokens))
                read += await asyncio.to_thread(reader.take, 1)
        async def published_all():  # the last put's event may still be on its way to the stream
            scrape = await asyncio.to_thread(crowded.scrape)
            return scrape if scrape.delta(before, "statetier_events_published_total") >= PUTS else None

        after = await eventually(published_all, "every put's event published")
        assert after.delta(before, "statetier_events_published_total") == PUTS
        assert after.delta(before, "statetier_events_dropped_total") == 0
        assert after.delta(before, "statetier_event_overflows_total") == 1  # the stuck one, once: it never read

        # the reader got every batch, in order: the stuck subscriber held up no one
        assert [event.block_hashes for _, _, batch in read for event in batch.events] == [[n] for n in range(PUTS)]
        seqs = [seq for _, seq, _ in read]
        assert seqs == list(range(seqs[0], seqs[0] + PUTS))

        # the stuck one got the first few (what its pipe and the socket buffers held), then a gap
        got = {seq: batch for _, seq, batch in stuck.drain(quiet=0.5)}
        assert 0 < len(got) < PUTS / 2
        assert sorted(got) == seqs[: len(got)]
        for _, seq, batch in stuck.replay(f"ipc://{crowded.directory}/replay", seqs[len(got)]):
            got.setdefault(seq, batch)
        assert [got[seq].events[0].block_hashes for seq in seqs] == [[n] for n in range(PUTS)]
    finally:
        stuck.close()
        reader.close()


async def test_a_tag_naming_more_tokens_than_its_key_spans_is_refused_and_nothing_is_announced(crowded):
    reader = Subscriber(f"ipc://{crowded.directory}/ev")
    try:
        await subscribed(crowded, 1)
        spec = NamespaceSpec(model_id="events-refused", kv_block_size=16)
        async with AsyncClient(crowded.url, namespace=spec) as client:
            key = client.kv_key(0, bytes(32), 0, 16)
            with pytest.raises(InvalidRequest, match="the tag names 17 tokens; the key spans 16"):
                await client.put(key, {"kv": torch.zeros(16, 8)}, request_id="r", tag=BlockTag(1, None, tuple(range(17))))
            with pytest.raises(NotFound):
                await client.load(key)
        assert reader.drain(0.5) == []
    finally:
        reader.close()
