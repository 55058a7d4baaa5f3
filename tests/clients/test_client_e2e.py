"""The client SDK against the real daemon, started as a subprocess (``statetier serve``).

Shapes are Jamba-mini's: 28 SSM layers, each a conv state (3, 8192) bf16 and an SSM
state (8192, 16) fp32, and 4 attention layers with KV pages (2, 8, tokens, 128) bf16.
Every test works in its own namespace or request ids, so one daemon serves the module.
KV pages of the "blocks" layout are keyed by the prefix hash at their block's end.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from statetier.clients import AsyncClient, Client, PutItem
from statetier.clients.batches import load_batch_items
from statetier.clients.tensors import tensor_bytes
from statetier.launch import DaemonProcess
from statetier.protocol.errors import (
    ClientClosedError,
    DestinationMismatch,
    InvalidRequest,
    NamespaceMismatch,
    NotFound,
    StaleState,
)
from statetier.protocol.identity import NamespaceSpec, prefix_hashes
from statetier.protocol.ownership import owned_key
from tests.support.waiting import eventually

try:
    import statetier.daemon.app  # noqa: F401
except ImportError:
    pytest.skip("daemon not available yet", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SSM_LAYERS = 28
ATTENTION_LAYERS = 4
BLOCK = 16


def jamba_namespace(label: str) -> NamespaceSpec:
    return NamespaceSpec(model_id=f"ai21labs/Jamba-mini-{label}", kv_block_size=BLOCK, kv_dtype="bfloat16",
                         ssm_dtype="float32", conv_dtype="bfloat16", conv_layout="(3,8192)")


def snapshot(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"conv": torch.randn(3, 8192, generator=gen).to(torch.bfloat16),
            "ssm": torch.randn(8192, 16, generator=gen)}


def kv_page(seed: int, tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(2, 8, tokens, 128, generator=gen).to(torch.bfloat16)}


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def token_ids(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 65_000, (n,), generator=gen).tolist()


# -- the daemon process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon_url():
    with DaemonProcess(name="e2e", host_capacity="256MiB") as daemon:
        yield daemon.url


# -- exact round trips ---------------------------------------------------------------------


async def _jamba_round_trip(url: str, *, use_shm: bool) -> None:
    spec = jamba_namespace("shm" if use_shm else "inline")
    tokens = token_ids(1 if use_shm else 2, 256)
    prefix = prefix_hashes(tokens, BLOCK)[-1]
    async with AsyncClient(url, namespace=spec, use_shm=use_shm, producer_id="prefill-0") as client:
        assert client.uses_shm is use_shm
        items, wanted = [], []
        for layer in range(SSM_LAYERS):
            tensors = snapshot(seed=layer)
            items.append(PutItem(client.ssm_key(layer, prefix, len(tokens)), tensors, request_id="jamba-req"))
            wanted.append(tensors)
        for layer in range(ATTENTION_LAYERS):
            tensors = kv_page(seed=100 + layer, tokens=len(tokens))
            items.append(PutItem(client.kv_key(SSM_LAYERS + layer, prefix, 0, len(tokens)), tensors,
                                 request_id="jamba-req"))
            wanted.append(tensors)
        refs = await client.put_many(items)
        # stored in the namespace the connection's tenant owns (protocol.ownership)
        assert [ref.key for ref in refs] == [owned_key(client.tenant, item.key) for item in items]
        assert all(ref.request_id == "jamba-req" and ref.version >= 1 for ref in refs)

        loaded = await client.load_many(refs)
        for got, want in zip(loaded, wanted):
            assert_same_tensors(got, want)

        ref, tensors = await client.load_with_ref(refs[0], expect={"conv": (torch.bfloat16, (3, 8192)),
                                                                  "ssm": (torch.float32, (8192, 16))})
        assert ref == refs[0]
        assert_same_tensors(tensors, wanted[0])
        by_key = await client.load(items[-1].key)  # prefix reuse: by key, no ref
        assert_same_tensors(by_key, wanted[-1])

        stats = await client.stats()
        assert stats["leases"] == 0


async def test_jamba_mini_round_trip_through_shared_memory(daemon_url: str) -> None:
    await _jamba_round_trip(daemon_url, use_shm=True)


async def test_jamba_mini_round_trip_inline(daemon_url: str) -> None:
    await _jamba_round_trip(daemon_url, use_shm=False)


async def test_odd_shapes_and_dtypes_round_trip(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("odd")) as client:
        tensors = {"scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.empty(0, 7, dtype=torch.float16),
                   "f8": torch.linspace(-4, 4, 33).to(torch.float8_e4m3fn),
                   "strided": torch.arange(60, dtype=torch.int32).reshape(6, 10)[:, ::3]}
        ref = await client.put_kv(0, bytes(32), 0, 33, tensors, request_id="odd")
        got = await client.load(ref)
        for name, tensor in tensors.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
            assert torch.equal(tensor_bytes(got[name]), tensor_bytes(tensor)), name


# -- joint hits ----------------------------------------------------------------------------


class HybridPrefix:
    """A prompt of 4 blocks and a tiny hybrid model: attention layers 0, 1; SSM layers 2, 3."""

    attention = (0, 1)
    ssm = (2, 3)

    def __init__(self, client: AsyncClient, seed: int) -> None:
        self.client = client
        self.tokens = token_ids(seed, 4 * BLOCK)
        self.hashes = prefix_hashes(self.tokens, BLOCK)
        self.request_id = f"hybrid-{seed}"

    def end(self, block: int) -> int:
        return (block + 1) * BLOCK

    async def put_pages(self, *, skip: set[tuple[int, int]] = frozenset()) -> None:
        """KV pages of every block of every attention layer, except ``(layer, block)`` in skip."""
        for layer in self.attention:
            for block in range(4):
                if (layer, block) not in skip:
                    await self.client.put_kv(layer, self.hashes[block], block * BLOCK, self.end(block),
                                             kv_page(layer * 10 + block, BLOCK), request_id=self.request_id)

    async def put_snapshots(self, block: int, *, tokens_absorbed: int | None = None) -> None:
        absorbed = self.end(block) if tokens_absorbed is None else tokens_absorbed
        for layer in self.ssm:
            await self.client.put_ssm(layer, self.hashes[block], absorbed, snapshot(layer + block),
                                      request_id=self.request_id)

    async def lookup(self) -> int:
        found = await self.client.lookup(self.attention, self.ssm, token_ids=self.tokens)
        await self.client.release(found.lease_ids)
        return found.tokens


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "inline"])
async def test_items_alike_but_for_one_dtype_or_shape_each_keep_their_own_layout(daemon_url: str,
                                                                                use_shm: bool) -> None:
    # the client builds a layout once per (name, dtype, shape) list: it must never lend one
    # item's layout to another that differs in any of them
    pages = [{"kv": torch.arange(64, dtype=torch.float32).reshape(8, 8)},
             {"kv": torch.arange(64, dtype=torch.int16).reshape(8, 8)},
             {"kv": torch.arange(48, dtype=torch.float32).reshape(6, 8)},
             {"kv": torch.arange(64, dtype=torch.float32).reshape(8, 8) + 1},
             {"kv": torch.arange(64, dtype=torch.float32).reshape(8, 8), "extra": torch.ones(3)}]
    async with AsyncClient(daemon_url, namespace=jamba_namespace(f"layouts-{use_shm}"), use_shm=use_shm) as client:
        items = [PutItem(client.kv_key(i, bytes(32), 0, 16), page, request_id="layouts")
                 for i, page in enumerate(pages)]
        for got, want in zip(await client.load_many(await client.put_many(items)), pages):
            assert_same_tensors(got, want)
        with pytest.raises(InvalidRequest, match="not a torch.Tensor"):  # refused after its name's layout was built
            await client.put_kv(0, bytes(32), 0, 16, {"kv": [1, 2, 3]}, request_id="layouts")


async def test_lookup_answers_the_largest_boundary_with_every_layer(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("lookup-full")) as client:
        prefix = HybridPrefix(client, seed=10)
        await prefix.put_pages()
        await prefix.put_snapshots(block=1)
        await prefix.put_snapshots(block=3)
        found = await client.lookup(prefix.attention, prefix.ssm, token_ids=prefix.tokens)
        try:
            assert found.tokens == 64
            kinds = sorted((ref.key.kind.name, ref.key.layer, ref.key.token_end) for ref in found.refs)
            assert kinds == sorted([("SSM", 2, 64), ("SSM", 3, 64)]
                                   + [("KV", layer, end) for layer in (0, 1) for end in (16, 32, 48, 64)])
            assert len(found.lease_ids) == len(found.objects)
            assert (await client.stats())["leases"] >= len(found.lease_ids)
        finally:
            assert await client.release(found.lease_ids) == len(found.lease_ids)
        boundaries = [(BLOCK * (i + 1), h) for i, h in enumerate(prefix.hashes)]
        unleased = await client.lookup(prefix.attention, prefix.ssm, boundaries, lease=False)
        assert unleased.tokens == 64 and unleased.lease_ids == []


async def test_lookup_without_the_last_snapshot_falls_back_to_an_earlier_one(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("lookup-missing")) as client:
        prefix = HybridPrefix(client, seed=11)
        await prefix.put_pages()
        assert await prefix.lookup() == 0  # KV everywhere but no snapshot: never a KV-only hit
        await prefix.put_snapshots(block=1)
        assert await prefix.lookup() == 32


async def test_lookup_ignores_a_snapshot_off_by_one_token(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("lookup-offbyone")) as client:
        prefix = HybridPrefix(client, seed=12)
        await prefix.put_pages()
        await prefix.put_snapshots(block=0)
        await prefix.put_snapshots(block=3, tokens_absorbed=63)
        await prefix.put_snapshots(block=2, tokens_absorbed=49)
        assert await prefix.lookup() == 16


async def test_lookup_with_a_missing_kv_page_answers_below_the_gap(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("lookup-gap")) as client:
        prefix = HybridPrefix(client, seed=13)
        await prefix.put_pages(skip={(1, 2)})  # layer 1 lacks tokens [32, 48)
        for block in range(4):
            await prefix.put_snapshots(block=block)
        assert await prefix.lookup() == 32


# -- fencing and isolation -----------------------------------------------------------------


async def test_stale_version_is_rejected(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("stale")) as client:
        prefix = prefix_hashes(token_ids(20, 32), BLOCK)[-1]
        first = await client.put_ssm(5, prefix, 32, snapshot(1), request_id="stale-req")
        second = await client.put_ssm(5, prefix, 32, snapshot(2), request_id="stale-req")
        assert second.version > first.version and second.state_id != first.state_id
        with pytest.raises(StaleState) as info:
            await client.load(first)
        assert info.value.reason == "stale"
        assert_same_tensors(await client.load(second), snapshot(2))
        with pytest.raises(StaleState):
            await client.put_ssm(5, prefix, 32, snapshot(3), request_id="stale-req", version=second.version)


async def test_consumer_with_another_namespace_is_refused(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("producer")) as producer, \
               AsyncClient(daemon_url, namespace=jamba_namespace("consumer")) as consumer:
        ref = await producer.put_ssm(0, bytes(32), 16, snapshot(0), request_id="ns-req")
        with pytest.raises(NamespaceMismatch):
            await consumer.load(ref)
        assert_same_tensors(await producer.load(ref), snapshot(0))


async def test_delete_then_load_is_not_found_and_closed_client_refuses(daemon_url: str) -> None:
    client = AsyncClient(daemon_url, namespace=jamba_namespace("delete"))
    await client.connect()
    ref = await client.put_kv(0, bytes(32), 0, 16, kv_page(0, 16), request_id="del-req")
    assert await client.delete(ref) >= 1
    with pytest.raises(NotFound):
        await client.load(ref)
    await client.close()
    with pytest.raises(ClientClosedError):
        await client.ping()


async def test_cancelled_loads_leave_no_lease_behind(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("cancel")) as client:
        refs = [await client.put_kv(layer, bytes(32), 0, 64, kv_page(layer, 64), request_id="cancel-req")
                for layer in range(4)]
        tasks = [asyncio.ensure_future(client.load(ref)) for ref in refs for _ in range(4)]
        await asyncio.sleep(0)
        for task in tasks[::2]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        async def no_lease() -> bool:  # orphaned replies are released in the background
            return (await client.stats())["leases"] == 0

        await eventually(no_lease, "every lease released")


async def test_cancelled_puts_leave_no_store_in_progress(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("cancel-put")) as client:
        pages = [kv_page(layer, 256) for layer in range(8)]  # 1 MiB each: copies off the loop
        tasks = [asyncio.ensure_future(client.put_kv(layer, bytes(32), 0, 256, page, request_id="cancel-put"))
                 for layer, page in enumerate(pages)]
        await asyncio.sleep(0)
        for task in tasks[1::2]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        refs = [r for r in results if not isinstance(r, BaseException)]
        assert len(refs) >= 4  # the uncancelled half completed
        async def no_store_in_progress() -> bool:  # an orphaned put ends in the daemon on its own
            return not any(t["inflight"] for t in (await client.stats())["tiers"])

        await eventually(no_store_in_progress, "every store ended")
        stats = await client.stats()
        assert [t["inflight"] for t in stats["tiers"]] == [0] * len(stats["tiers"]) and stats["leases"] == 0
        for ref in refs:
            assert_same_tensors(await client.load(ref), pages[ref.key.layer])


# -- the blocking client -------------------------------------------------------------------


def test_sync_client_basics(daemon_url: str) -> None:
    spec = jamba_namespace("sync")
    tokens = token_ids(30, 32)
    hashes = prefix_hashes(tokens, BLOCK)
    with Client(daemon_url, namespace=spec, producer_id="sync-test") as client:
        assert client.ping() >= 0
        ssm = client.put_ssm(0, hashes[1], 32, snapshot(7), request_id="sync-req")
        kv = [client.put_kv(1, hashes[i], i * BLOCK, (i + 1) * BLOCK, kv_page(i, BLOCK), request_id="sync-req")
              for i in range(2)]
        assert_same_tensors(client.load(ssm), snapshot(7))
        assert_same_tensors(client.load_many(kv)[1], kv_page(1, BLOCK))
        found = client.lookup([1], [0], token_ids=tokens)
        assert found.tokens == 32
        client.release(found.lease_ids)
        header = client.inspect(ssm.state_id)
        assert header["header"]["state_id"] == ssm.state_id.hex()
        assert header["header"]["producer_id"] == "sync-test"
        assert "tiers" in client.stats()
    with pytest.raises(ClientClosedError):
        client.ping()


# -- loads into the caller's buffers -------------------------------------------------------


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "inline"])
async def test_load_into_fills_the_callers_tensors_in_place(daemon_url: str, use_shm: bool) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace(f"into-{use_shm}"), use_shm=use_shm) as client:
        want = [snapshot(seed=40 + i) for i in range(3)]
        refs = [await client.put_ssm(i, bytes(32), 64, t, request_id="into") for i, t in enumerate(want)]
        pool = [{"conv": torch.zeros(3, 8192, dtype=torch.bfloat16), "ssm": torch.zeros(8192, 16)}
                for _ in want]
        addresses = [{n: t.data_ptr() for n, t in slot.items()} for slot in pool]
        got = await client.load(refs[0], into=pool[0])
        assert got["conv"] is pool[0]["conv"] and got["ssm"] is pool[0]["ssm"]
        assert_same_tensors(pool[0], want[0])
        await client.load_many(refs[1:], into=pool[1:])
        for slot, tensors, address in zip(pool, want, addresses):
            assert_same_tensors(slot, tensors)
            assert {n: t.data_ptr() for n, t in slot.items()} == address  # filled, never replaced


async def test_load_into_a_mismatched_buffer_is_a_typed_error_and_leaves_it_untouched(daemon_url: str) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace("into-mismatch")) as client:
        ref = await client.put_ssm(0, bytes(32), 64, snapshot(seed=5), request_id="into")
        wrong_shape = {"conv": torch.full((3, 8191), 7, dtype=torch.bfloat16), "ssm": torch.zeros(8192, 16)}
        wrong_dtype = {"conv": torch.zeros(3, 8192, dtype=torch.float16), "ssm": torch.zeros(8192, 16)}
        missing = {"conv": torch.zeros(3, 8192, dtype=torch.bfloat16)}
        for into in (wrong_shape, wrong_dtype, missing):
            with pytest.raises(DestinationMismatch):
                await client.load(ref, into=into)
        assert bool((wrong_shape["conv"] == 7).all())
        strided = {"conv": torch.zeros(8192, 3, dtype=torch.bfloat16).t(), "ssm": torch.zeros(8192, 16)}
        with pytest.raises(InvalidRequest, match="contiguous"):
            await client.load(ref, into=strided)
        with pytest.raises(InvalidRequest, match="cpu"):
            await client.load(ref, into={"conv": torch.zeros(3, 8192, dtype=torch.bfloat16),
                                         "ssm": torch.zeros(8192, 16, device="meta")})
        assert_same_tensors(await client.load(ref), snapshot(seed=5))


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "inline"])
async def test_a_load_many_cut_into_frames_in_flight_keeps_order_and_the_first_failure(daemon_url: str,
                                                                                       use_shm: bool) -> None:
    """24 targets travel as several LOAD_BATCH frames, two in flight: every result in its
    target's place, and a missing object in a later frame is the error, at its position."""
    assert load_batch_items(24) < 24  # more than one frame
    async with AsyncClient(daemon_url, namespace=jamba_namespace(f"frames-{use_shm}"), use_shm=use_shm) as client:
        refs = [await client.put_ssm(i, bytes(32), 64, snapshot(seed=80 + i), request_id="frames") for i in range(24)]
        for got, i in zip(await client.load_many(refs), range(24)):
            assert_same_tensors(got, snapshot(seed=80 + i))
        await client.delete(refs[17])
        with pytest.raises(NotFound) as caught:
            await client.load_many(refs)
        assert caught.value.detail["item"] == 17
        with pytest.raises(NotFound) as caught:
            await client.load_many(refs, concurrency=1)  # one frame after the other
        assert caught.value.detail["item"] == 17
        for got, i in zip(await client.load_many(refs[:17]), range(17)):  # the connection still serves
            assert_same_tensors(got, snapshot(seed=80 + i))


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "inline"])
async def test_a_failing_batch_item_names_its_position_in_the_call(daemon_url: str, use_shm: bool) -> None:
    async with AsyncClient(daemon_url, namespace=jamba_namespace(f"batch-item-{use_shm}"), use_shm=use_shm) as client:
        refs = [await client.put_ssm(i, bytes(32), 64, snapshot(seed=60 + i), request_id="item") for i in range(4)]
        await client.delete(refs[2])
        with pytest.raises(NotFound) as caught:
            await client.load_many(refs)
        assert caught.value.detail["item"] == 2
        dup = PutItem(refs[0].key, snapshot(seed=60), request_id="item", version=refs[0].version)
        fresh = [PutItem(client.ssm_key(9, bytes(32), 64), snapshot(seed=70), request_id="item-new"), dup]
        with pytest.raises(StaleState) as caught:
            await client.put_many(fresh)
        assert caught.value.detail["item"] == 1
