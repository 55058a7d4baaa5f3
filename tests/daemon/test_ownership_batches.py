"""Namespace ownership through issue 21's entry points: batches and group objects.

Alice puts a request's state as one batch: a KV group object per block (two attention
layers each) and an SSM group object at the boundary (two Mamba layers), beside a
per-layer page. Bob sends the very same requests — same spec, keys and request ids — as
another tenant. Every namespace he names is taken into his own (``daemon.engine.tenancy``),
so by batch of keys he finds nothing, by a batch of Alice's refs and by a partial group load
of her ref he is refused (``NamespaceMismatch``), by key with chosen layers nothing, and his
lookup over the groups answers 0 tokens. Once he puts his own state under the same keys,
each tenant's batches, partial loads and lookups find their own bytes only. Real engine,
real host tier; the real-uid, real-daemon version is ``test_e2e_ownership.py``.
"""

from __future__ import annotations

import pytest

from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.requests import Incoming, LoadRequest, LoadResult, LookupRequest, PutRequest, PutResult
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import NamespaceMismatch, NotFound
from statetier.protocol.groups import LayerGroup, chosen, region_name
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, prefix_hashes
from statetier.protocol.keyring import Keyring
from statetier.protocol.ownership import is_owned_by
from statetier.protocol.sealed import layout_payload
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.registry import MemoryVersionRegistry

NS = NamespaceSpec("owned-groups", tenant="alice").namespace()  # what both tenants name
BLOCK, BLOCKS = 16, 2
CHAIN = prefix_hashes(list(range(BLOCK * BLOCKS)), BLOCK)
ATTENTION = LayerGroup(Kind.KV, 0, (1, 3))
MAMBA = LayerGroup(Kind.SSM, 1, (0, 2))
KV_REGION = ("k", "v")
SSM_REGION = ("conv", "ssm")


def specs(group: LayerGroup) -> tuple[TensorSpec, ...]:
    names = KV_REGION if group.kind is Kind.KV else SSM_REGION
    return tuple(TensorSpec(region_name(layer, name), "float32", (8, 32)) for layer in group.layers for name in names)


def keys() -> list[StateKey]:
    """The request's objects: a KV group object per block, the SSM group object at the
    boundary, and one per-layer page (layer 5, block 0)."""
    blocks = [ATTENTION.key(NS, CHAIN[b], b * BLOCK, (b + 1) * BLOCK) for b in range(BLOCKS)]
    return [*blocks, MAMBA.key(NS, CHAIN[-1], 0, BLOCK * BLOCKS), StateKey(NS, Kind.KV, 5, CHAIN[0], 0, BLOCK)]


def specs_of(key: StateKey) -> tuple[TensorSpec, ...]:
    group = LayerGroup.of_key(key)
    return specs(group) if group else (TensorSpec("kv", "float32", (8, 32)),)


def payload(key: StateKey, tenant: str) -> bytes:
    n = layout_payload(specs_of(key)).payload_len
    seed = (tenant + key.prefix_hash.hex() + str(key.layer)).encode()
    return (seed * (n // len(seed) + 1))[:n]


def batch(tenant: str) -> list[Incoming]:
    return [Incoming(PutRequest(tenant, key, Provenance("req"), specs_of(key)), memoryview(payload(key, tenant)))
            for key in keys()]


def lookup(tenant: str) -> LookupRequest:
    bounds = tuple(((b + 1) * BLOCK, CHAIN[b]) for b in range(BLOCKS))
    return LookupRequest(tenant, NS, (), (), bounds, groups=(ATTENTION, MAMBA), lease=False)


@pytest.fixture
async def engine():
    host = HostTier(HostTierOptions(8 << 20, granularity=4096))
    engine = Engine([host], keyring=Keyring.generate(), registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="test"), arena=host)
    await engine.start()
    yield engine
    await engine.close()


async def loaded(engine: Engine, reqs: list[LoadRequest]) -> list:
    """Each answer of one load batch: the payload's bytes, or the error (None: not attempted)."""
    answers = await engine.load_batch(reqs, owner="c")
    await engine.release_many([a.lease_id for a in answers if isinstance(a, LoadResult)], "c")
    return [bytes(a.payload) if isinstance(a, LoadResult) else a for a in answers]


def partial(answer: LoadResult | None, layers: tuple[int, ...]) -> list[str]:
    return [d.spec.name for d in chosen(answer.header.tensors, layers)]


async def test_a_tenant_naming_anothers_namespace_finds_nothing_of_its_batches_and_group_objects(engine):
    stored = await engine.put_batch(batch("alice"))
    assert all(isinstance(s, PutResult) and is_owned_by(s.ref.key.namespace, "alice") for s in stored)
    refs = [s.ref for s in stored]
    assert [ref.key.group_layers for ref in refs] == [ATTENTION.layers] * BLOCKS + [MAMBA.layers, ()]

    by_ref = await loaded(engine, [LoadRequest("bob", NS, ref=ref) for ref in refs])
    assert isinstance(by_ref[0], NamespaceMismatch) and by_ref[1:] == [None] * 3  # the batch stops at the first
    by_key = await loaded(engine, [LoadRequest("bob", NS, key=key) for key in keys()])
    assert isinstance(by_key[0], NotFound) and by_key[1:] == [None] * 3
    (layer_by_ref,) = await loaded(engine, [LoadRequest("bob", NS, ref=refs[1], layers=(3,))])
    assert isinstance(layer_by_ref, NamespaceMismatch)
    (layer_by_key,) = await loaded(engine, [LoadRequest("bob", NS, key=keys()[2], layers=(2,))])
    assert isinstance(layer_by_key, NotFound)
    assert (await engine.lookup(lookup("bob"), "c")).tokens == 0
    assert (await engine.lookup(lookup("alice"), "c")).tokens == BLOCK * BLOCKS

    assert all(isinstance(s, PutResult) for s in await engine.put_batch(batch("bob")))  # the same keys, his own
    for tenant in ("alice", "bob"):
        assert await loaded(engine, [LoadRequest(tenant, NS, key=key) for key in keys()]) == \
            [payload(key, tenant) for key in keys()]
        assert (await engine.lookup(lookup(tenant), "c")).tokens == BLOCK * BLOCKS
        (ssm,) = await engine.load_batch([LoadRequest(tenant, NS, key=keys()[2], layers=(2,))], owner="c")
        assert partial(ssm, (2,)) == ["2.conv", "2.ssm"] and is_owned_by(ssm.header.key.namespace, tenant)
        await engine.release(ssm.lease_id, "c")
    assert await loaded(engine, [LoadRequest("alice", NS, ref=ref) for ref in refs]) == \
        [payload(key, "alice") for key in keys()]
