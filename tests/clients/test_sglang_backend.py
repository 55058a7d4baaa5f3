"""The SGLang HiCache backend against a real daemon, with stand-ins of SGLang's host pools.

Each story runs SGLang's side as its controller does: a backup thread calls ``batch_set_*``
with the page hashes of a request and the host slots holding them, a prefetch (often on
another backend instance: another node, another process) calls ``batch_exists*`` and then
``batch_get_*`` into other slots. What must hold: bytes come back equal; anything wrong is
``False`` with its reason counted, never raised and never ``None``.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from pathlib import Path

import pytest
import torch

from statetier.clients import sglang as backend_module
from statetier.clients.sglang import HiCacheBackend, prefix_bytes
from statetier.protocol.errors import InvalidRequest
from tests.support.daemons import daemon_fixture
from tests.support.sglang_pools import (
    PAGE,
    ExtraInfo,
    KVPoolHost,
    LayerFirstKVPoolHost,
    MambaPoolHost,
    StorageConfig,
    Transfer,
    chain,
    slots,
)


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, settings={"disk.fsync": "false"})


@pytest.fixture(scope="module")
def disk_daemon(request):
    """Objects land on disk (no host tier), where a test can damage them."""
    return daemon_fixture(request, host_capacity=None, settings={"host.enabled": "false", "disk.fsync": "false"},
                          name="disk")


def make_backend(url: str, *, revision: str = "rev-a", kv_pool=None, mamba_pool=None, **config) -> HiCacheBackend:
    extra = {"backend_name": "statetier", "module_path": "statetier.clients.sglang",
             "class_name": "StatetierHiCacheStorage", "interface_v1": 1, "url": url,
             "weights_revision": revision}
    # SGLang's own subclass when SGLang is installed (make test-sglang), else the plain backend
    backend = backend_module.StatetierHiCacheStorage(StorageConfig(extra_config=extra, **config), {})
    kv_pool = kv_pool if kv_pool is not None else KVPoolHost()
    backend.register_mem_pool_host(kv_pool)
    backend.register_mem_host_pool_v2(kv_pool, "kv")
    if mamba_pool is not None:
        backend.register_mem_host_pool_v2(mamba_pool, "mamba")
    backend.on_host_pools_registered()
    return backend


@pytest.fixture
def backends(daemon):
    made = []

    def make(**kwargs) -> HiCacheBackend:
        made.append(make_backend(daemon.url, **kwargs))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def backed_up(backend: HiCacheBackend, keys: list[str], first_slot: int = 0, seed: int = 0) -> list[torch.Tensor]:
    pool = backend.mem_pool_host
    for i in range(len(keys)):
        pool.fill_page(first_slot + i * PAGE, seed * 1000 + i)
    assert backend.batch_set_v1(keys, slots(first_slot, len(keys)), ExtraInfo([])) == [True] * len(keys)
    return [pool.page(first_slot + i * PAGE) for i in range(len(keys))]


# -- KV, v1 ----------------------------------------------------------------------------------


def test_a_backed_up_request_prefetches_into_other_slots_byte_for_byte(backends):
    producer, consumer = backends(), backends()
    keys = chain(1, 5)
    pages = backed_up(producer, keys, first_slot=0, seed=1)
    assert consumer.batch_exists(keys, ExtraInfo([])) == 5
    assert consumer.batch_get_v1(keys, slots(64, 5), ExtraInfo([])) == [True] * 5
    for i, page in enumerate(pages):
        got = consumer.mem_pool_host.page(64 + i * PAGE)
        assert torch.equal(got.view(torch.int16), page.view(torch.int16))
    assert consumer.get_stats()["served"] == {"kv": 5}


def test_exists_counts_present_pages_from_the_first_and_a_get_agrees(backends):
    producer, consumer = backends(), backends()
    keys = chain(2, 6)
    backed_up(producer, keys[:4], seed=2)
    assert consumer.batch_exists(keys, ExtraInfo([])) == 4
    assert consumer.batch_get_v1(keys, slots(0, 6), ExtraInfo([])) == [True] * 4 + [False] * 2
    # a batch in the middle of the chain names its predecessors in prefix_keys
    assert consumer.batch_exists(keys[2:], ExtraInfo(keys[:2])) == 2
    assert consumer.batch_get_v1(keys[2:4], slots(0, 2), ExtraInfo(keys[:2])) == [True, True]


def test_a_hole_in_the_chain_ends_the_hit_even_when_later_pages_exist(backends):
    producer, consumer = backends(), backends()
    keys = chain(3, 4)
    backed_up(producer, keys[:1], seed=3)
    producer.mem_pool_host.fill_page(32, 99)
    producer.batch_set_v1(keys[2:], slots(32, 2), ExtraInfo(keys[:2]))
    assert consumer.batch_exists(keys, ExtraInfo([])) == 1


def test_a_page_at_another_position_is_not_served(backends):
    """The same page hash with a prefix_keys one page short names another token span."""
    producer, consumer = backends(), backends()
    keys = chain(4, 3)
    backed_up(producer, keys, seed=4)
    assert consumer.batch_get_v1(keys[2:], slots(0, 1), ExtraInfo(keys[:1])) == [False]
    assert consumer.get_stats()["refused"] == {"not_found": 1}


def test_pages_of_other_weights_are_never_returned(backends):
    producer, consumer = backends(revision="rev-a"), backends(revision="rev-b")
    keys = chain(5, 2)
    backed_up(producer, keys, seed=5)
    assert consumer.batch_exists(keys, ExtraInfo([])) == 0
    assert consumer.batch_get_v1(keys, slots(0, 2), ExtraInfo([])) == [False, False]
    assert consumer.mem_pool_host.kv_buffer.count_nonzero() == 0
    assert consumer.get_stats()["refused"] == {"not_found": 1}


def test_pages_of_another_layout_are_never_returned(backends):
    producer = backends()
    consumer = backends(kv_pool=KVPoolHost(head_dim=64))
    keys = chain(6, 1)
    backed_up(producer, keys, seed=6)
    assert consumer.batch_exists(keys, ExtraInfo([])) == 0
    assert consumer.batch_get_v1(keys, slots(0, 1), ExtraInfo([])) == [False]


def test_without_token_positions_nothing_is_stored_or_served(backends):
    backend = backends()
    keys = chain(7, 2)
    assert backend.batch_set_v1(keys, slots(0, 2), ExtraInfo(None)) == [False, False]
    assert backend.batch_exists(keys, None) == 0
    assert backend.batch_get_v1(keys, slots(0, 2), None) == [False, False]
    assert backend.get(keys[0], torch.zeros(4)) is None
    assert backend.set(keys[0], torch.zeros(4)) is False
    assert backend.batch_get(keys) == [None, None]
    assert backend.get_stats()["refused"] == {"position_unknown": 2 + 2 + 2 + 1 + 1 + 2}


def test_mismatched_host_indices_are_refused_not_raised(backends):
    backend = backends()
    assert backend.batch_set_v1(chain(8, 2), slots(0, 1), ExtraInfo([])) == [False, False]


def test_a_layer_first_pool_round_trips_through_the_copying_path(backends):
    producer = backends(kv_pool=LayerFirstKVPoolHost())
    consumer = backends(kv_pool=LayerFirstKVPoolHost())
    keys = chain(9, 2)
    pages = backed_up(producer, keys, seed=9)
    assert consumer.batch_get_v1(keys, slots(32, 2), ExtraInfo([])) == [True, True]
    for i, page in enumerate(pages):
        assert torch.equal(consumer.mem_pool_host.page(32 + i * PAGE).view(torch.int16), page.view(torch.int16))


def test_an_mla_rank_other_than_the_writer_reads_the_writers_pages_and_writes_nothing(backends):
    writer = backends(is_mla_model=True, tp_size=2, tp_rank=0)
    reader = backends(is_mla_model=True, tp_size=2, tp_rank=1)
    keys = chain(10, 2)
    assert reader.batch_set_v1(keys, slots(0, 2), ExtraInfo([])) == [True, True]
    assert writer.batch_exists(keys, ExtraInfo([])) == 0  # the reader stored nothing
    pages = backed_up(writer, keys, seed=10)
    assert reader.batch_get_v1(keys, slots(0, 2), ExtraInfo([])) == [True, True]
    assert torch.equal(reader.mem_pool_host.page(0).view(torch.int16), pages[0].view(torch.int16))


def test_ranks_of_a_sharded_model_never_see_each_others_pages(backends):
    rank0, rank1 = backends(tp_size=2, tp_rank=0), backends(tp_size=2, tp_rank=1)
    keys = chain(11, 2)
    backed_up(rank0, keys, seed=11)
    assert rank1.batch_get_v1(keys, slots(0, 2), ExtraInfo([])) == [False, False]
    assert rank1.mem_pool_host.kv_buffer.count_nonzero() == 0


def test_every_rank_answers_the_pages_that_all_ranks_hold(backends):
    rank0, rank1 = backends(tp_size=2, tp_rank=0), backends(tp_size=2, tp_rank=1)
    keys = chain(14, 3)
    backed_up(rank0, keys, seed=14)
    backed_up(rank1, keys[:2], seed=15)
    assert [rank0.batch_exists(keys, ExtraInfo([])), rank1.batch_exists(keys, ExtraInfo([]))] == [2, 2]


def test_backup_and_prefetch_run_from_two_threads_at_once(backends):
    backend = backends(kv_pool=KVPoolHost(size=2048))
    stored = chain(12, 8)
    backed_up(backend, stored, seed=12)
    failures: list = []

    def backup() -> None:
        for round_ in range(10):
            keys = chain(100 + round_, 4)
            if backend.batch_set_v1(keys, slots(1024, 4), ExtraInfo([])) != [True] * 4:
                failures.append(("set", round_))

    def prefetch() -> None:
        for round_ in range(10):
            if backend.batch_exists(stored, ExtraInfo([])) != 8:
                failures.append(("exists", round_))
            if backend.batch_get_v1(stored, slots(512, 8), ExtraInfo([])) != [True] * 8:
                failures.append(("get", round_))

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == []
    for i in range(8):
        assert torch.equal(backend.mem_pool_host.page(512 + i * PAGE).view(torch.int16),
                           backend.mem_pool_host.page(i * PAGE).view(torch.int16))


def test_clear_deletes_what_the_backend_stored(backends):
    backend = backends()
    keys = chain(13, 3)
    backed_up(backend, keys, seed=13)
    assert backend.batch_exists(keys, ExtraInfo([])) == 3
    assert backend.clear() is True
    assert backend.batch_exists(keys, ExtraInfo([])) == 0


# -- damaged objects ---------------------------------------------------------------------------


def _segment_bytes(daemon) -> list[Path]:
    return sorted((daemon.disk_dir / "segments").glob("seg-*.dat"))


def test_a_flipped_byte_on_disk_is_a_miss_with_its_reason(disk_daemon):
    producer, consumer = make_backend(disk_daemon.url), make_backend(disk_daemon.url)
    try:
        keys = chain(20, 1)
        pages = backed_up(producer, keys, seed=20)
        needle = pages[0][0].contiguous().view(torch.uint8).numpy().tobytes()[:64]
        (segment,) = [s for s in _segment_bytes(disk_daemon) if needle in s.read_bytes()]
        data = bytearray(segment.read_bytes())
        at = data.find(needle) + 7
        with open(segment, "r+b") as file:
            file.seek(at)
            file.write(bytes([data[at] ^ 0x10]))
        assert consumer.batch_get_v1(keys, slots(0, 1), ExtraInfo([])) == [False]
        assert consumer.get_stats()["refused"] == {"corrupt_payload": 1}
        assert consumer.mem_pool_host.kv_buffer.count_nonzero() == 0
    finally:
        producer.close()
        consumer.close()


def test_a_truncated_object_on_disk_is_a_miss_with_its_reason(disk_daemon):
    producer, consumer = make_backend(disk_daemon.url), make_backend(disk_daemon.url)
    try:
        keys = chain(21, 1)
        pages = backed_up(producer, keys, seed=21)
        needle = pages[0][1].contiguous().view(torch.uint8).numpy().tobytes()[-64:]
        (segment,) = [s for s in _segment_bytes(disk_daemon) if needle in s.read_bytes()]
        cut = segment.read_bytes().find(needle)
        with open(segment, "r+b") as file:
            file.truncate(cut)
        assert consumer.batch_get_v1(keys, slots(0, 1), ExtraInfo([])) == [False]
        assert consumer.get_stats()["refused"] == {"truncated": 1}
    finally:
        producer.close()
        consumer.close()


# -- hybrid, v2 ----------------------------------------------------------------------------------


def hybrid_backend(backends, **kwargs) -> HiCacheBackend:
    return backends(mamba_pool=MambaPoolHost(), **kwargs)


def back_up_hybrid(backend: HiCacheBackend, keys: list[str], snapshot_at: int, mamba_slot: int, seed: int):
    """KV pages of ``keys`` and the Mamba slot as of the end of page ``snapshot_at`` (1-based)."""
    backed_up(backend, keys, seed=seed)
    mamba = backend.registered_pools["mamba"]
    mamba.fill_slot(mamba_slot, seed)
    transfer = Transfer("mamba", [keys[snapshot_at - 1]], torch.tensor([mamba_slot]))
    result = backend.batch_set_v2([transfer], ExtraInfo(keys[: snapshot_at - 1]))
    assert result == {"mamba": [True]}
    return mamba.slot(mamba_slot)


def test_a_mamba_snapshot_is_restored_typed_into_its_slot(backends):
    producer, consumer = hybrid_backend(backends), hybrid_backend(backends)
    keys = chain(30, 4)
    want = back_up_hybrid(producer, keys, snapshot_at=4, mamba_slot=2, seed=30)
    probe = Transfer("mamba", [keys[-1]])
    result = consumer.batch_exists_v2(keys, [probe], ExtraInfo([]))
    assert (result.kv_hit_pages, result.extra_pool_hit_pages, result.restorable_prefix_pages) == \
        (4, {"kv": 4, "mamba": 4}, [4])
    got = consumer.batch_get_v2([Transfer("mamba", [keys[-1]], torch.tensor([7]))], ExtraInfo(keys[:3]))
    assert got == {"mamba": [True]}
    for have, expected in zip(consumer.registered_pools["mamba"].slot(7), want):
        assert have.dtype == expected.dtype and torch.equal(have, expected)


def test_the_hit_ends_where_the_snapshot_is_one_page_stale(backends):
    producer, consumer = hybrid_backend(backends), hybrid_backend(backends)
    keys = chain(31, 4)
    back_up_hybrid(producer, keys, snapshot_at=3, mamba_slot=0, seed=31)  # state after page 3 only
    result = consumer.batch_exists_v2(keys, [Transfer("mamba", [keys[-1]])], ExtraInfo([]))
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [3])
    # asking for the state at page 4 is a miss, never the page-3 state
    got = consumer.batch_get_v2([Transfer("mamba", [keys[3]], torch.tensor([5]))], ExtraInfo(keys[:3]))
    assert got == {"mamba": [False]}
    assert consumer.registered_pools["mamba"].temporal_buffer[5].count_nonzero() == 0
    assert consumer.get_stats()["refused"] == {"not_found": 1}


def test_a_snapshot_of_another_prefix_is_never_restored(backends):
    producer, consumer = hybrid_backend(backends), hybrid_backend(backends)
    ours, theirs = chain(32, 3), chain(33, 3)
    back_up_hybrid(producer, theirs, snapshot_at=3, mamba_slot=1, seed=33)
    backed_up(producer, ours, seed=32)  # our KV is there, the snapshot is theirs
    result = consumer.batch_exists_v2(ours, [Transfer("mamba", [ours[-1]])], ExtraInfo([]))
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    got = consumer.batch_get_v2([Transfer("mamba", [ours[-1]], torch.tensor([4]))], ExtraInfo(ours[:2]))
    assert got == {"mamba": [False]}


def test_a_snapshot_of_another_rank_is_never_restored(backends):
    rank0 = hybrid_backend(backends, tp_size=2, tp_rank=0)
    rank1 = hybrid_backend(backends, tp_size=2, tp_rank=1)
    keys = chain(34, 2)
    back_up_hybrid(rank0, keys, snapshot_at=2, mamba_slot=0, seed=34)
    backed_up(rank1, keys, seed=34)  # rank 1's KV shard, but not its Mamba state
    result = rank1.batch_exists_v2(keys, [Transfer("mamba", [keys[-1]])], ExtraInfo([]))
    assert result.restorable_prefix_pages == []
    got = rank1.batch_get_v2([Transfer("mamba", [keys[-1]], torch.tensor([3]))], ExtraInfo(keys[:1]))
    assert got == {"mamba": [False]}


def test_an_unknown_sidecar_pool_makes_nothing_restorable(backends):
    backend = backends()
    keys = chain(35, 2)
    backed_up(backend, keys, seed=35)
    result = backend.batch_exists_v2(keys, [Transfer("swa", keys)], ExtraInfo([]))
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])


# -- configuration and import ----------------------------------------------------------------------


def test_an_mla_model_with_a_mamba_pool_is_refused_at_start(daemon):
    with pytest.raises(InvalidRequest, match="MLA"):
        make_backend(daemon.url, mamba_pool=MambaPoolHost(), is_mla_model=True)


def test_the_extra_config_must_name_the_daemon_and_the_weights_revision():
    with pytest.raises(InvalidRequest, match="weights_revision"):
        HiCacheBackend(StorageConfig(extra_config={"url": "unix:///nowhere.sock"}))
    with pytest.raises(InvalidRequest, match="unknown extra-config keys"):
        HiCacheBackend(StorageConfig(extra_config={"url": "unix:///x", "weights_revision": "r", "urll": 1}))


def test_page_hashes_become_32_byte_prefix_hashes():
    digest = hashlib.sha256(b"x").digest()
    assert prefix_bytes(digest.hex()) == digest
    assert len(prefix_bytes("not-hex")) == 32 and prefix_bytes("not-hex") == prefix_bytes("not-hex")


def test_the_storage_class_is_sglangs_subclass_when_sglang_is_installed():
    cls = backend_module.StatetierHiCacheStorage
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    except ImportError:
        assert cls is HiCacheBackend
    else:
        assert issubclass(cls, HiCacheStorage) and issubclass(cls, HiCacheBackend)


def test_the_module_imports_without_loading_sglang():
    import subprocess

    probe = ("import sys, statetier.clients.sglang as m\n"
             "print(sorted(x for x in sys.modules if x.split('.')[0] == 'sglang'))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
