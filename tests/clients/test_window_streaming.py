"""No cliff past the window (issue 21, item 6): a load batch larger than the connection's
load window streams through it in window-sized steps.

A daemon whose windows are 4 MiB serves eight 1.5 MiB pages in one ``load_many`` call with
one frame in flight: each ``LOAD_BATCH`` carries what the window has room for (two pages)
and answers the rest ``retry``; the client lands them, gives the regions back with its next
frame, and asks for the rest — four frames, every payload through the window, none inline
and none loaded alone, every byte verified where it landed.
"""

from __future__ import annotations

import collections

import pytest
import torch

from statetier.clients import AsyncClient
from statetier.launch import DaemonProcess
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
        conn, frames = client._connection(), collections.Counter()
        sent, answered = conn.request, []

        async def counted(op, meta, *args, **kwargs):
            frames[op] += 1
            frame = await sent(op, meta, *args, **kwargs)
            if op is Op.LOAD_BATCH:
                answered.append([(a.window is not None, a.retry) for a in decode_reply(LoadBatchReply, frame.meta).items])
            return frame

        monkeypatch.setattr(conn, "request", counted)
        loaded = await client.load_many(refs, concurrency=1)
        assert all(torch.equal(got["kv"], want["kv"]) for got, want in zip(loaded, pages))
        assert frames == {Op.LOAD_BATCH: 4}  # no LOAD of one page alone
        assert [sum(window for window, _ in step) for step in answered] == [2, 2, 2, 2]  # all through the window
        assert [sum(retry for _, retry in step) for step in answered] == [6, 4, 2, 0]
