"""The backend as SGLang builds and calls it: ``StorageBackendFactory.create_backend("dynamic", …)``
with SGLang's own config, transfer and result types. Runs where SGLang is installed
(``make test-sglang``); skipped in the default suite, which tests the same logic without it.
"""

from __future__ import annotations

import pytest
import torch

storage = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from statetier.clients.sglang import HiCacheBackend  # noqa: E402
from tests.support.daemons import daemon_fixture  # noqa: E402
from tests.support.sglang_pools import PAGE, KVPoolHost, MambaPoolHost, chain, slots  # noqa: E402


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, settings={"disk.fsync": "false"})


def build(url: str, *, tp_rank: int = 0):
    config = storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="ibm-granite/granite-4.0-h-tiny",
        extra_config={"backend_name": "statetier", "module_path": "statetier.clients.sglang",
                      "class_name": "StatetierHiCacheStorage", "interface_v1": 1,
                      "url": url, "weights_revision": "rev-a"})
    kv, mamba = KVPoolHost(), MambaPoolHost()
    backend = factory.StorageBackendFactory.create_backend("dynamic", config, kv)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, storage.PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, storage.PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend, kv, mamba


def test_the_factory_builds_a_hicache_storage(daemon):
    backend, _, _ = build(daemon.url)
    try:
        assert isinstance(backend, storage.HiCacheStorage) and isinstance(backend, HiCacheBackend)
    finally:
        backend.close()


def test_a_hybrid_request_round_trips_through_sglangs_own_types(daemon):
    producer, kv, mamba = build(daemon.url)
    consumer, kv2, mamba2 = build(daemon.url)
    try:
        keys = chain(40, 3)
        for i in range(3):
            kv.fill_page(i * PAGE, 40 + i)
        mamba.fill_slot(1, 40)
        info = storage.HiCacheStorageExtraInfo(prefix_keys=[])
        assert producer.batch_set_v1(keys, slots(0, 3), info) == [True, True, True]
        written = producer.batch_set_v2(
            [storage.PoolTransfer(name=storage.PoolName.MAMBA, keys=[keys[-1]], host_indices=torch.tensor([1]),
                                  hit_policy=storage.PoolHitPolicy.TRAILING_PAGES)],
            storage.HiCacheStorageExtraInfo(prefix_keys=keys[:2]))
        assert written == {"mamba": [True]}

        probe = storage.PoolTransfer(name=storage.PoolName.MAMBA, keys=[keys[-1]],
                                     hit_policy=storage.PoolHitPolicy.TRAILING_PAGES)
        result = consumer.batch_exists_v2(keys, [probe], info)
        assert isinstance(result, storage.PoolTransferResult)
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [3])
        assert consumer.batch_get_v1(keys, slots(32, 3), info) == [True, True, True]
        got = consumer.batch_get_v2(
            [storage.PoolTransfer(name=storage.PoolName.MAMBA, keys=[keys[-1]], host_indices=torch.tensor([6]))],
            storage.HiCacheStorageExtraInfo(prefix_keys=keys[:2]))
        assert got == {"mamba": [True]}
        assert torch.equal(kv2.page(32).view(torch.int16), kv.page(0).view(torch.int16))
        assert all(torch.equal(a, b) for a, b in zip(mamba2.slot(6), mamba.slot(1)))
    finally:
        producer.close()
        consumer.close()
