"""Group objects through the SDK and a real daemon (issue 21, item 4).

A Jamba-mini-like request in group objects: one KV object per 256-token block holding
its 4 attention layers, one SSM object per boundary holding its 28 Mamba layers. They
are put, loaded whole or by chosen layers (straight into caller buffers; the daemon then
sends only those layers' regions), batched beside per-layer objects, and found by the
joint-hit lookup over groups (a boundary counts only when every group's object on every
shard is there). A wrong layer set, a missing layer and a layer of another group are
refused with DESIGN §4's placement reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from statetier.clients import AsyncClient, Client, LayerGroup, PutItem
from statetier.launch import DaemonProcess
from statetier.protocol.errors import InvalidRequest, NotFound, PlacementMismatch
from statetier.protocol.frames import Op
from statetier.protocol.identity import Kind, NamespaceSpec, prefix_hashes
from statetier.protocol.wire_meta import PutMeta, wire_key, wire_provenance, wire_specs
from statetier.protocol.identity import Provenance
from statetier.protocol.ownership import owned_key
from statetier.protocol.dtypes import TensorSpec

BLOCK = 256
ATTENTION = LayerGroup(Kind.KV, 0, (4, 12, 20, 28))
MAMBA = LayerGroup(Kind.SSM, 1, tuple(layer for layer in range(32) if layer % 8 != 4))


def namespace(label: str, tp_size: int = 1) -> NamespaceSpec:
    return NamespaceSpec(model_id=f"ai21labs/Jamba-mini-groups-{label}", kv_block_size=BLOCK, kv_dtype="bfloat16",
                         ssm_dtype="float32", conv_dtype="bfloat16", tp_size=tp_size)


def kv_regions(seed: int, layers=ATTENTION.layers) -> dict[int, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {layer: {name: torch.randn(8, 16, 128, generator=gen).to(torch.bfloat16) for name in ("k", "v")}
            for layer in layers}


def ssm_regions(seed: int) -> dict[int, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {layer: {"conv": torch.randn(3, 512, generator=gen).to(torch.bfloat16),
                    "ssm": torch.randn(512, 16, generator=gen)} for layer in MAMBA.layers}


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for layer in want:
        assert list(got[layer]) == list(want[layer]), layer
        for name, tensor in want[layer].items():
            assert torch.equal(got[layer][name], tensor), (layer, name)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 65_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def daemon_url():
    with DaemonProcess(name="groups", host_capacity="256MiB") as daemon:
        yield daemon.url


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "inline"])
async def test_group_objects_load_whole_or_by_chosen_layers_into_caller_buffers(daemon_url, use_shm):
    async with AsyncClient(daemon_url, namespace=namespace(f"rt-{use_shm}"), use_shm=use_shm) as client:
        assert client.uses_shm is use_shm
        prefix = prefix_hashes(tokens(1, BLOCK), BLOCK)[0]
        kv, ssm = kv_regions(1), ssm_regions(2)
        kv_ref = await client.put_group(client.group_key(ATTENTION, prefix, 0, BLOCK), kv, request_id="rt")
        ssm_ref = await client.put_group(client.group_key(MAMBA, prefix, 0, BLOCK), ssm, request_id="rt")
        assert kv_ref.key.group_layers == ATTENTION.layers and kv_ref.key.layer == 0

        assert_same(await client.load_group(kv_ref), kv)
        assert_same(await client.load_group(ssm_ref.key), ssm)  # by key: prefix reuse
        assert_same(await client.load_group(kv_ref, layers=[20, 4]), {4: kv[4], 20: kv[20]})

        into = {12: {"k": torch.empty(8, 16, 128, dtype=torch.bfloat16),
                     "v": torch.empty(8, 16, 128, dtype=torch.bfloat16)}}
        filled = await client.load_group(kv_ref, into=into)
        assert filled[12]["k"] is into[12]["k"] and filled[12]["v"] is into[12]["v"]
        assert_same(filled, {12: kv[12]})

        per_layer = await client.put_kv(40, prefix, 0, BLOCK, {"kv": kv[4]["k"]}, request_id="rt")
        slot = {MAMBA.layers[-1]: {name: torch.empty_like(t) for name, t in ssm[MAMBA.layers[-1]].items()}}
        loaded = await client.load_many([kv_ref, per_layer, ssm_ref], into=[None, None, slot])
        assert_same(loaded[0], kv)
        assert torch.equal(loaded[1]["kv"], kv[4]["k"])  # a per-layer object keeps working beside them
        assert loaded[2][MAMBA.layers[-1]]["ssm"] is slot[MAMBA.layers[-1]]["ssm"]
        assert_same(loaded[2], {MAMBA.layers[-1]: ssm[MAMBA.layers[-1]]})


async def test_put_many_carries_group_objects_and_the_sync_client_mirrors_them(daemon_url):
    spec = namespace("many")
    chain = prefix_hashes(tokens(3, 4 * BLOCK), BLOCK)
    with Client(daemon_url, namespace=spec) as client:
        items = [PutItem(client.group_key(ATTENTION, chain[b], b * BLOCK, (b + 1) * BLOCK), kv_regions(10 + b),
                         request_id="many") for b in range(4)]
        items.append(PutItem(client.group_key(MAMBA, chain[-1], 0, 4 * BLOCK), ssm_regions(20), request_id="many"))
        refs = client.put_many(items)
        # stored under the namespace the connection's tenant owns (protocol.ownership)
        assert [ref.key for ref in refs] == [owned_key("default", item.key) for item in items]
        for ref, item in zip(refs, items):
            assert_same(client.load_group(ref), item.tensors)
        assert_same(client.load_group(refs[2], layers=[28]), {28: items[2].tensors[28]})


async def test_the_joint_hit_over_groups_needs_every_groups_object_on_every_shard(daemon_url):
    async with AsyncClient(daemon_url, namespace=namespace("hit", tp_size=2)) as client:
        prompt = tokens(4, 8 * BLOCK)
        chain = prefix_hashes(prompt, BLOCK)
        kv = kv_regions(5)
        for shard in (0, 1):
            for b in range(8):
                if (shard, b) == (1, 6):
                    continue  # shard 1 lacks block 6: only boundaries up to 6 blocks hold on every shard
                await client.put_group(client.group_key(ATTENTION, chain[b], b * BLOCK, (b + 1) * BLOCK, shard=shard),
                                       kv, request_id="hit")
            for b in (3, 5, 7):  # SSM group objects at three boundaries
                await client.put_group(client.group_key(MAMBA, chain[b], 0, (b + 1) * BLOCK, shard=shard),
                                       ssm_regions(b), request_id="hit")

        hit = await client.lookup(groups=[ATTENTION, MAMBA], token_ids=prompt)
        assert hit.tokens == 6 * BLOCK  # 8 blocks lack shard 1's block 6; 7 has no SSM object
        assert len(hit.refs) == 2 * (6 + 1)  # 6 KV blocks and 1 SSM object, on each of 2 shards
        assert {(ref.key.kind, ref.key.layer, ref.key.group_layers) for ref in hit.refs} == {
            (Kind.KV, 0, ATTENTION.layers), (Kind.SSM, 1, MAMBA.layers)}
        assert await client.release(hit.lease_ids) == len(hit.refs)

        kv_only = await client.lookup(groups=[ATTENTION], token_ids=prompt, lease=False)
        assert kv_only.tokens == 6 * BLOCK
        other_group = LayerGroup(Kind.SSM, 1, MAMBA.layers[:-1])  # another layer set: other objects
        assert (await client.lookup(groups=[ATTENTION, other_group], token_ids=prompt, lease=False)).tokens == 0


async def test_a_group_stored_once_for_every_shard_is_found_with_its_shard_count(daemon_url):
    """A state every TP rank holds the same (vLLM's ``MambaSpec.tp_replicated``) stored once, as
    shard 0: ``group_shards`` says so; the daemon refuses a count past the TP size."""
    async with AsyncClient(daemon_url, namespace=namespace("once", tp_size=2)) as client:
        prompt = tokens(8, 2 * BLOCK)
        chain = prefix_hashes(prompt, BLOCK)
        for shard in (0, 1):
            for b in range(2):
                await client.put_group(client.group_key(ATTENTION, chain[b], b * BLOCK, (b + 1) * BLOCK, shard=shard),
                                       kv_regions(b), request_id="once")
        await client.put_group(client.group_key(MAMBA, chain[1], 0, 2 * BLOCK), ssm_regions(1), request_id="once")

        assert (await client.lookup(groups=[ATTENTION, MAMBA], token_ids=prompt, lease=False)).tokens == 0
        hit = await client.lookup(groups=[ATTENTION, MAMBA], group_shards=[2, 1], token_ids=prompt, lease=False)
        assert hit.tokens == 2 * BLOCK
        assert len(hit.refs) == 2 * 2 + 1  # 2 KV blocks on each shard, the SSM object once
        with pytest.raises(InvalidRequest, match="one shard count per group"):
            await client.lookup(groups=[ATTENTION, MAMBA], group_shards=[1], token_ids=prompt)
        with pytest.raises(InvalidRequest, match="shard count must be 1"):  # the daemon's check
            await client.lookup(groups=[ATTENTION, MAMBA], group_shards=[2, 3], token_ids=prompt)


async def test_a_group_object_missing_a_layer_or_holding_another_is_refused(daemon_url):
    async with AsyncClient(daemon_url, namespace=namespace("refuse")) as client:
        prefix = bytes(32)
        key = client.group_key(ATTENTION, prefix, 0, BLOCK)
        with pytest.raises(PlacementMismatch, match=r"misses layers \[28\]"):
            await client.put_group(key, kv_regions(6, ATTENTION.layers[:-1]), request_id="refuse")
        with pytest.raises(PlacementMismatch, match=r"layers \[5\] are not in group 0"):
            await client.put_group(key, kv_regions(6, (*ATTENTION.layers, 5)), request_id="refuse")
        with pytest.raises(InvalidRequest, match="group key"):
            await client.put_group(client.kv_key(4, prefix, 0, BLOCK), kv_regions(6), request_id="refuse")

        # The daemon refuses the same without the SDK's check (a raw PUT), counted by its reason.
        regions = kv_regions(6, ATTENTION.layers[:-1])
        pairs = [(f"{layer}.{name}", t) for layer, r in regions.items() for name, t in r.items()]
        meta = PutMeta(wire_key(key), wire_provenance(Provenance("raw")),
                       wire_specs([TensorSpec(n, "bfloat16", tuple(t.shape)) for n, t in pairs]))
        data = b"".join(t.view(torch.uint8).numpy().tobytes() for _, t in pairs)
        with pytest.raises(PlacementMismatch, match=r"misses layers \[28\]"):
            await client._connection().request(Op.PUT, meta, data)
        with pytest.raises(NotFound):  # nothing stored under that key
            await client.load_group(key)

        ref = await client.put_group(key, kv_regions(7), request_id="refuse")
        with pytest.raises(PlacementMismatch, match=r"layers \[5\] are not in group 0"):
            await client.load_group(ref, layers=[4, 5])  # a layer of another group
        wrong_set = dataclasses.replace(ref, key=dataclasses.replace(ref.key, group_layers=(4, 12, 20, 29)))
        with pytest.raises(PlacementMismatch):  # the object under that state_id holds another layer set
            await client.load_group(wrong_set)
        with pytest.raises(InvalidRequest, match="group object"):
            await client.load_group(await client.put_kv(4, prefix, 0, BLOCK, {"kv": kv_regions(1)[4]["k"]},
                                                        request_id="refuse"))
