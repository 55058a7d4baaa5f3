"""No cliff past the window (issue 21, item 6; issue 33, item 1): a load batch larger than
the connection's load window streams through it in half-window steps, pipelined.

A daemon whose windows are 4 MiB serves eight 1.5 MiB pages in one ``load_many`` call with
one frame in flight: each ``LOAD_BATCH`` reply takes at most half the window (one page) and
answers the rest ``retry``; the client asks for the next step as soon as a reply arrives,
before it lands this one, so the daemon fills the other half while the client copies and
verifies — eight frames, every payload through the window, none inline and none loaded
alone, every byte verified where it landed, and every step k+1 asked before step k's
region went back. The same with ``into`` (the caller's tensors filled in place).
"""

from __future__ import annotations

import pytest
import torch

from statetier.clients import AsyncClient, PutItem
from statetier.launch import DaemonProcess
from statetier.protocol.errors import InvalidRequest, NotFound
from statetier.protocol.frames import Op
from statetier.protocol.identity import NamespaceSpec
from statetier.protocol.wire_meta import LoadBatchReply, decode_reply


@pytest.fixture(scope="module")
def small_windows():
    with DaemonProcess(name="window", host_capacity="128MiB", settings={"host.window_bytes": "4MiB"}) as daemon:
        yield daemon.url


async def test_a_load_batch_larger_than_the_window_streams_through_it(small_windows, monkeypatch):
    async with AsyncClient(small_windows, namespace=NamespaceSpec("window-steps")) as client:
        assert client.uses_shm and client._transfers.windows.load_window.nbytes == 4 << 20
        pages = [{"kv": torch.randint(-100, 100, (768, 1024), dtype=torch.int16)} for _ in range(8)]  # 1.5 MiB
        refs = [await client.put_kv(layer, bytes(32), 0, 16, page, request_id="steps") for layer, page in
                enumerate(pages)]
        for into in (None, [{"kv": torch.empty_like(page["kv"])} for page in pages]):
            events = _counted_steps(client, monkeypatch)
            trace: dict = {}
            loaded = await client.load_many(refs, concurrency=1, into=into, trace=trace)
            assert all(torch.equal(got["kv"], want["kv"]) for got, want in zip(loaded, pages))
            if into is not None:
                assert all(got["kv"] is dest["kv"] for got, dest in zip(loaded, into))
            asks = [event for event in events if event[0] == "ask"]
            assert [event[1] for event in asks] == [Op.LOAD_BATCH] * 8 and trace["window_steps"] == 8  # none alone
            assert [event[2] for event in asks] == [1] * 8  # all through the window, half of it a step
            assert [event[3] for event in asks] == [7, 6, 5, 4, 3, 2, 1, 0]
            kinds = [event[0] for event in events]
            assert kinds == ["ask"] + ["ask", "landed"] * 7 + ["landed"]  # step k+1 asked before k landed
            monkeypatch.undo()


def _counted_steps(client, monkeypatch) -> list[tuple]:
    """Each request as ("ask", op, payloads through the window, retries) once answered, in the
    order asked, and each step's regions given back as ("landed",)."""
    conn, transfers, events = client._connection(), client._transfers, []
    sent, give_back = conn.request, transfers._give_back

    async def counted(op, meta, *args, **kwargs):
        event = ["ask", op, 0, 0]
        events.append(event)
        frame = await sent(op, meta, *args, **kwargs)
        if op is Op.LOAD_BATCH:
            items = decode_reply(LoadBatchReply, frame.meta).items
            event[2:] = [sum(a.window is not None for a in items), sum(a.retry for a in items)]
        return frame

    def given(regions):
        events.append(("landed",))
        give_back(regions)

    monkeypatch.setattr(conn, "request", counted)
    monkeypatch.setattr(transfers, "_give_back", given)
    return events


async def test_a_put_batch_larger_than_the_window_streams_through_it(small_windows, monkeypatch):
    """Eight 2 MiB pages (half the 4 MiB put window each) in one ``put_many``: one frame per
    page, in order, each from the window (none inline), and frame k+1 filled into the other
    half of the window before frame k was answered."""
    async with AsyncClient(small_windows, namespace=NamespaceSpec("window-put-steps")) as client:
        transfers = client._transfers
        pages = [{"kv": torch.randint(-100, 100, (1024, 1024), dtype=torch.int16)} for _ in range(8)]  # 2 MiB
        items = [PutItem(client.kv_key(layer, bytes(32), 0, 16), page, request_id="put-steps")
                 for layer, page in enumerate(pages)]
        conn, events = client._connection(), []
        sent, fill = conn.request, transfers.fill_put_batch

        async def counted(op, meta, data=b"", **kwargs):
            if op is Op.PUT_BATCH:
                events.append(("sent", [m.window is not None for m in meta.items], len(data)))
            frame = await sent(op, meta, data, **kwargs)
            if op is Op.PUT_BATCH:
                events.append(("answered",))
            return frame

        async def filled(batch):
            events.append(("filled",))
            return await fill(batch)

        monkeypatch.setattr(conn, "request", counted)
        monkeypatch.setattr(transfers, "fill_put_batch", filled)
        trace: dict = {}
        refs = await client.put_many(items, trace=trace)
        assert trace["window_steps"] == 8 and len(refs) == 8
        assert [event[1:] for event in events if event[0] == "sent"] == [([True], 0)] * 8  # all from the window
        kinds = [event[0] for event in events]
        assert kinds == ["filled"] + ["sent", "filled", "answered"] * 7 + ["sent", "answered"]
        monkeypatch.undo()
        loaded = await client.load_many(refs)
        assert all(torch.equal(got["kv"], want["kv"]) for got, want in zip(loaded, pages))


async def test_a_put_batch_that_cannot_be_filled_fails_in_its_turn(small_windows):
    """The fifth of eight pages cannot be laid out (a quantized tensor): the four before it
    are stored and none after it, as when the frames were filled one after the other,
    though its fill was first tried while the fourth was in flight."""
    async with AsyncClient(small_windows, namespace=NamespaceSpec("window-put-fails")) as client:
        pages = [{"kv": torch.randint(-100, 100, (1024, 1024), dtype=torch.int16)} for _ in range(8)]  # 2 MiB
        pages[4] = {"kv": torch.quantize_per_tensor(torch.zeros(1024, 1024), 0.1, 0, torch.qint8)}
        items = [PutItem(client.kv_key(layer, bytes(32), 0, 16), page, request_id="put-fails")
                 for layer, page in enumerate(pages)]
        with pytest.raises(InvalidRequest, match="quantized"):
            await client.put_many(items)
        stored = [await client.load(client.kv_key(layer, bytes(32), 0, 16)) for layer in range(4)]
        assert all(torch.equal(got["kv"], want["kv"]) for got, want in zip(stored, pages))
        for layer in range(4, 8):
            with pytest.raises(NotFound):
                await client.load(client.kv_key(layer, bytes(32), 0, 16))
