"""Allocation that costs nothing extra (issue 33, item 2): a load that allocates a large
result lands it in memory the SDK recycles, so the copy does not fault page by page.

A real daemon, a 32 MiB page: the first allocating load faults its result's pages in (a
fresh mapping), the next ones — the result before dropped — take a small fraction of the
8,192 faults of a fresh 32 MiB buffer (counted with ``getrusage``, no timing); memory a
result or any view of it still uses is never handed out again; a small result is plain
``torch.empty``.
"""

from __future__ import annotations

import gc
import resource
import statistics

import pytest
import torch

from statetier.clients import AsyncClient
from statetier.clients.results import ResultPool
from statetier.launch import DaemonProcess
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import NamespaceSpec

FRESH_32MIB_FAULTS = 8192  # one per 4 KiB page


@pytest.fixture(scope="module")
def daemon_url():
    with DaemonProcess(name="results", host_capacity="256MiB") as daemon:
        yield daemon.url


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


async def test_an_allocating_load_of_32mib_reuses_faulted_memory(daemon_url):
    async with AsyncClient(daemon_url, namespace=NamespaceSpec("results")) as client:
        page = {"kv": torch.randint(-100, 100, (16 << 20,), dtype=torch.int16)}  # 32 MiB
        ref = await client.put_kv(0, bytes(32), 0, 16, page, request_id="results")
        first = await client.load(ref)
        assert torch.equal(first["kv"], page["kv"])
        del first
        gc.collect()
        counts = []
        for _ in range(3):
            before = _faults()
            loaded = await client.load(ref)
            counts.append(_faults() - before)
            assert torch.equal(loaded["kv"], page["kv"])
            del loaded
        assert max(counts) < FRESH_32MIB_FAULTS // 8, counts
        assert client._transfers.results.handed_out == 0


def test_memory_a_view_still_uses_is_not_handed_out_again():
    pool = ResultPool()
    spec = TensorSpec("kv", "int16", (1 << 20,))  # 2 MiB
    first = pool.empty(spec)
    first.fill_(7)
    view = first[100:200]
    address = first.data_ptr()
    del first
    gc.collect()
    second = pool.empty(spec)
    assert second.data_ptr() != address and pool.handed_out == 2 and bool((view == 7).all())
    del view
    gc.collect()
    assert pool.handed_out == 1 and pool.kept_bytes == 2 << 20
    third = pool.empty(spec)
    assert third.data_ptr() == address and pool.kept_bytes == 0  # the freed mapping, reused
    assert pool.empty(TensorSpec("small", "int16", (1024,))).data_ptr() not in (address, second.data_ptr())
    assert pool.handed_out == 2  # the small one is plain torch.empty


def _daemon_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])  # minflt, field 10


async def test_inline_frames_reuse_faulted_memory_at_both_ends():
    """Two 8 MiB inline LOAD_BATCH replies in flight at once (8 × 2 MiB, no shared-memory
    window): the client's frame bodies and the daemon's reply data are recycled memory, so
    after the first calls neither process faults their pages in again (a fresh 8 MiB buffer
    is 2,048 faults; the issue 33 regression took 4,124 a call in the client)."""
    # host.populate off: its thread faults the arena in beside the calls, and minflt counts every thread
    with DaemonProcess(name="inline-faults", host_capacity="256MiB",
                       settings={"disk.enabled": "false", "host.populate": "false"}) as daemon:
        async with AsyncClient(daemon.url, namespace=NamespaceSpec("inline"), use_shm=False) as client:
            pages = [{"kv": torch.randint(-100, 100, (1 << 20,), dtype=torch.int16)} for _ in range(8)]
            refs = [await client.put_kv(i * 16, bytes(32), i * 16, i * 16 + 16, page, request_id=f"r{i}")
                    for i, page in enumerate(pages)]
            into = [{"kv": torch.empty_like(page["kv"])} for page in pages]
            for _ in range(3):  # until each end holds as many buffers as it has in flight at once
                await client.load_many(refs, into=into)
            counts = []
            for _ in range(5):
                before, daemon_before = _faults(), _daemon_faults(daemon.pid)
                await client.load_many(refs, into=into)
                counts.append((_faults() - before, _daemon_faults(daemon.pid) - daemon_before))
                assert all(torch.equal(a["kv"], b["kv"]) for a, b in zip(into, pages))
    # the median call: now and then a third reply is still being written when the next is built
    # (the transport holds what it could not send at once), and the pool maps one buffer more
    assert statistics.median(c for c, _ in counts) < 2048 // 4, counts
    assert statistics.median(d for _, d in counts) < 2048 // 4, counts
