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
