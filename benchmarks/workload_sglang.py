"""The SGLang HiCache backend against the SDK's own batched calls on the same pages.

``run_sglang(pages, reps, directory, progress) -> rows`` starts its own daemon
(``procs.own_daemon``: host arena only), fills a page-first KV host pool (the
stand-in of ``tests/support/sglang_pools.py``, SGLang's buffer layout) with ``pages`` pages
of a Qwen3-Next-80B-like geometry (12 attention layers × 2 KV heads × 256, bfloat16, 64
tokens a page: 1.5 MiB), then per repetition, alternating:

- ``batch_set_v1`` of every page, and the SDK's ``put_many`` of the same page tensors;
- ``batch_get_v1`` of every page into other slots, and the SDK's ``load_many(into=…)`` of
  the same objects into the same slots (the caller-buffer form);

Rows: suite ``sglang``, ops ``batch_set_v1`` / ``batch_get_v1``, raw = the SDK call, ratio =
SDK time ÷ backend time (1.0: the backend costs nothing over the SDK; the target is a
backend at most 1.2× the SDK, a ratio ≥ 0.83). Loaded bytes are compared with what was
stored after the first repetition, outside the timing.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests" / "support") not in sys.path:
    sys.path.insert(0, str(REPO / "tests" / "support"))

PAGE_TOKENS = 64
GEOMETRY = {"layer_num": 12, "head_num": 2, "head_dim": 256}


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(url: str, pages: int, reps: int, progress) -> list[dict]:
    import torch

    from sglang_pools import ExtraInfo, KVPoolHost, StorageConfig, chain
    from statetier.clients import Client, PutItem
    from statetier.clients.sglang import HiCacheBackend, prefix_bytes
    from statetier.protocol.identity import NamespaceSpec
    from .workload_raw import paired_row

    pool = KVPoolHost(size=2 * pages * PAGE_TOKENS, page_size=PAGE_TOKENS, **GEOMETRY)
    for i in range(pages):
        pool.fill_page(i * PAGE_TOKENS, i)
    backend = HiCacheBackend(StorageConfig({"url": url, "weights_revision": "bench"},
                                           model_name="bench/qwen3-next-like"))
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, "kv")
    source = torch.arange(0, pages * PAGE_TOKENS, dtype=torch.int64)
    target = source + pages * PAGE_TOKENS
    page_bytes = 2 * PAGE_TOKENS * GEOMETRY["layer_num"] * GEOMETRY["head_num"] * GEOMETRY["head_dim"] * 2

    def page(slot: int) -> list:  # the slot's K and V pages: views of the pool, as SGLang lays them out
        return [("k", pool.kv_buffer[0, slot: slot + PAGE_TOKENS]), ("v", pool.kv_buffer[1, slot: slot + PAGE_TOKENS])]

    times: dict[str, list[float]] = {name: [] for name in ("set", "put", "get", "load")}
    sdk = Client(url, namespace=NamespaceSpec("bench/sdk-baseline", kv_block_size=PAGE_TOKENS)).connect()
    try:
        for rep in range(reps + 1):  # repetition 0 warms up and checks the bytes
            keys = chain(rep, pages)
            items = [PutItem(sdk.kv_key(0, prefix_bytes(h), i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS),
                             page(i * PAGE_TOKENS), request_id=h) for i, h in enumerate(keys)]
            refs: list = []

            def load_into_slots() -> None:
                sdk.load_many(refs, into=[dict(page((pages + i) * PAGE_TOKENS)) for i in range(pages)])

            t_set = _timed(lambda: _must(backend.batch_set_v1(keys, source, ExtraInfo([]))))
            t_put = _timed(lambda: refs.extend(sdk.put_many(items)))
            t_get = _timed(lambda: _must(backend.batch_get_v1(keys, target, ExtraInfo([]))))
            t_load = _timed(load_into_slots)
            if rep == 0:
                for i in range(pages):
                    a, b = pool.page(i * PAGE_TOKENS), pool.page((pages + i) * PAGE_TOKENS)
                    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"page {i} differs"
            else:
                for name, value in zip(times, (t_set, t_put, t_get, t_load)):
                    times[name].append(value)
            backend.clear()
            for ref in refs:
                sdk.delete(ref)
            progress(1)
    finally:
        sdk.close()
        backend.close()
    size = pages * page_bytes
    extra = {"pages": pages, "page_bytes": page_bytes, "reps": reps}
    return [paired_row("sglang", "host", "batch_set_v1", size, pages, times["set"], "SDK put_many", times["put"],
                       **extra),
            paired_row("sglang", "host", "batch_get_v1", size, pages, times["get"], "SDK load_many(into=)",
                       times["load"], **extra)]


def _must(results: list[bool]) -> None:
    if not all(results):
        raise RuntimeError(f"the SGLang backend moved {sum(results)} of {len(results)} pages")


async def run_sglang(pages: int, reps: int, directory, progress) -> list[dict]:
    from .procs import own_daemon

    async with own_daemon(directory) as daemon:
        return await asyncio.to_thread(measure, daemon.url, pages, reps, progress)
