"""``concurrency`` is honoured or refused, never silently capped.

A ``load_many`` keeps at most ``concurrency`` frames in flight (the client's, or the
call's): counted on the connection, the most requests it had unanswered at once. A
``put_many`` sends its frames one at a time (a stream's versions are claimed in order), so
it takes ``concurrency`` None or 1 only; anything else, and a count below 1 anywhere, is
``InvalidRequest`` before anything is sent.
"""

from __future__ import annotations

import pytest
import torch

from statetier.clients import AsyncClient, PutItem
from statetier.clients.async_client import DEFAULT_CONCURRENCY
from statetier.clients.batches import LOAD_IN_FLIGHT, load_batch_items
from statetier.launch import DaemonProcess
from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import NamespaceSpec

TARGETS = 16


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(name="concurrency", host_capacity="64MiB") as running:
        yield running


def namespace(label: str) -> NamespaceSpec:
    return NamespaceSpec(model_id=f"org/concurrency-{label}", kv_block_size=16, kv_dtype="bfloat16")


def page(seed: int) -> dict[str, torch.Tensor]:
    return {"kv": torch.full((2, 4, 16, 8), seed, dtype=torch.bfloat16)}


class InFlight:
    """Counts the requests the client's connection has sent and not yet had answered."""

    def __init__(self, client: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
        conn = client._connection()
        request = conn.request
        self.now = self.most = self.sent = 0

        async def counted(*args, **kwargs):
            self.now += 1
            self.sent += 1
            self.most = max(self.most, self.now)
            try:
                return await request(*args, **kwargs)
            finally:
                self.now -= 1

        monkeypatch.setattr(conn, "request", counted)

    def reset(self) -> None:
        self.most = self.sent = 0


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_count_below_one_or_not_an_int_is_refused_when_the_client_is_made(bad) -> None:
    with pytest.raises(InvalidRequest, match="concurrency"):
        AsyncClient("unix:///nonexistent", concurrency=bad)


def test_the_default_is_the_measured_pipeline_depth() -> None:
    assert DEFAULT_CONCURRENCY == LOAD_IN_FLIGHT == AsyncClient("unix:///nonexistent").concurrency


async def test_load_many_keeps_exactly_as_many_frames_in_flight_as_asked(daemon, monkeypatch) -> None:
    frames = -(-TARGETS // load_batch_items(TARGETS))
    assert frames == 4
    async with AsyncClient(daemon.url, namespace=namespace("load"), use_shm=False, concurrency=3) as client:
        refs = await client.put_many([PutItem(client.kv_key(0, bytes([n]) * 32, 0, 16), page(n), request_id=f"c{n}")
                                      for n in range(TARGETS)])
        spy = InFlight(client, monkeypatch)
        most = {}
        for concurrency in (None, 1, 2, 3, 4, 16):
            spy.reset()
            loaded = await client.load_many(refs, concurrency=concurrency)
            assert [int(got["kv"][0, 0, 0, 0]) for got in loaded] == list(range(TARGETS))
            assert spy.sent == (1 if concurrency == 1 else frames)  # 1: one frame after the other, as few as fit
            most[concurrency] = spy.most
        # None: the client's 3; more than the call's frames changes nothing
        assert most == {None: 3, 1: 1, 2: 2, 3: 3, 4: 4, 16: 4}
        with pytest.raises(InvalidRequest, match="concurrency"):
            await client.load_many(refs, concurrency=0)


async def test_put_many_takes_one_frame_at_a_time_and_refuses_more(daemon, monkeypatch) -> None:
    async with AsyncClient(daemon.url, namespace=namespace("put"), use_shm=False) as client:
        items = [PutItem(client.kv_key(0, bytes([n]) * 32, 0, 16), page(n), request_id=f"p{n}") for n in range(3)]
        spy = InFlight(client, monkeypatch)
        for refused in (2, 16, 0):
            with pytest.raises(InvalidRequest, match="concurrency"):
                await client.put_many(items, concurrency=refused)
        assert spy.sent == 0  # refused before anything was sent
        assert len(await client.put_many(items, concurrency=1)) == 3
        assert (spy.sent, spy.most) == (1, 1)
