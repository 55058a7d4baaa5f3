"""End to end, daemon in a subprocess: Jamba-mini state through real sockets.

- Round trips: 28 SSM snapshots (conv (3, 8192) bf16 + ssm (8192, 16) fp32) and 4 KV pages
  (2, 8, 256, 128) bf16, through shared memory and inline, bit for bit; lookup finds them.
- The joint-hit rule told as one story: no snapshot → 0, a layer's snapshot missing or
  off by one token → the earlier boundary, a KV page missing → below the gap.
- Fencing: a superseded version is ``StaleState``; forged refs are refused with the reason
  of the first check they fail (DESIGN §4): another request's state_id →
  ``FingerprintMismatch`` (step 7 comes before the registry's stream check of step 8),
  another layer's → ``PlacementMismatch``, another position's → ``PositionMismatch``, a
  state_id presented with another version → ``MisroutedState``; another model →
  ``NamespaceMismatch``. Refusals drop nothing: the genuine refs still load.
- Prefill and decode daemons sharing one real Redis (and one keyring): a published state
  is loaded, verified, on the other node; an unpublished one is not there; versions are
  fenced across nodes (they live in Redis).
"""

from __future__ import annotations

import dataclasses

import pytest

from statetier.clients import AsyncClient, PutItem
from statetier.protocol.errors import (
    FingerprintMismatch,
    MisroutedState,
    NamespaceMismatch,
    NotFound,
    PlacementMismatch,
    PositionMismatch,
    StaleState,
)
from statetier.protocol.identity import prefix_hashes
from statetier.protocol.ownership import owned_key
from tests.support.daemons import daemon_fixture
from tests.support.jamba import (
    ATTENTION_LAYERS,
    BLOCK,
    SSM_LAYERS,
    assert_same_tensors,
    jamba_namespace,
    kv_page,
    snapshot,
    token_ids,
)
from tests.support.keyrings import keyring_file

TOKENS = 256
ATTENTION = tuple(range(SSM_LAYERS, SSM_LAYERS + ATTENTION_LAYERS))  # layers 28..31
SSM = tuple(range(SSM_LAYERS))


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, name="state", host_capacity="256MiB")


@pytest.fixture(scope="module")
def shared_keyring():
    with keyring_file() as path:
        yield path


@pytest.fixture(scope="module")
def prefill(request, redis_server, shared_keyring):
    return daemon_fixture(request, name="prefill", redis_url=redis_server.url,
                          settings={"keys.keyring_file": shared_keyring, "producer_id": "prefill-0"})


@pytest.fixture(scope="module")
def decode(request, redis_server, shared_keyring):
    return daemon_fixture(request, name="decode", redis_url=redis_server.url,
                          settings={"keys.keyring_file": shared_keyring, "producer_id": "decode-0"})


def jamba_items(client: AsyncClient, prefix: bytes, request_id: str, seed: int = 0):
    """PutItems of a whole Jamba-mini state after TOKENS tokens, and the tensors of each."""
    items, tensors = [], []
    for layer in SSM:
        state = snapshot(seed + layer)
        items.append(PutItem(client.ssm_key(layer, prefix, TOKENS), state, request_id=request_id))
        tensors.append(state)
    for layer in ATTENTION:
        page = kv_page(seed + layer, TOKENS)
        items.append(PutItem(client.kv_key(layer, prefix, 0, TOKENS), page, request_id=request_id))
        tensors.append(page)
    return items, tensors


# -- exact round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "inline"])
async def test_jamba_mini_state_round_trips_exactly(daemon, use_shm: bool) -> None:
    spec = jamba_namespace(f"round-trip-{use_shm}")
    prefix = prefix_hashes(token_ids(1, TOKENS), BLOCK)[-1]
    async with AsyncClient(daemon.url, namespace=spec, use_shm=use_shm) as client:
        assert client.uses_shm is use_shm
        items, wanted = jamba_items(client, prefix, "rt-req")
        refs = await client.put_many(items)
        # stored under the namespace the connection's tenant owns, not the one the client named
        assert [ref.key for ref in refs] == [owned_key("default", item.key) for item in items]
        assert [ref.version for ref in refs] == [1] * len(items)

        for got, want in zip(await client.load_many(refs), wanted):
            assert_same_tensors(got, want)

        found = await client.lookup(ATTENTION, SSM, [(TOKENS, prefix)], kv_layout="prefix")
        try:
            assert found.tokens == TOKENS
            assert sorted(ref.state_id for ref in found.refs) == sorted(ref.state_id for ref in refs)
            assert len(found.lease_ids) == len(refs)
            for got, want in zip(await client.load_many(found.refs), wanted):
                assert_same_tensors(got, want)
        finally:
            assert await client.release(found.lease_ids) == len(refs)

        assert_same_tensors(await client.load(items[3].key), wanted[3])  # prefix reuse, by key
        stats = await client.stats()
        assert stats["leases"] == 0 and "reservations" not in stats


# -- joint hits ----------------------------------------------------------------------------


class JambaPrompt:
    """A 256-token prompt in 4 blocks of 64, over the full Jamba-mini layer set."""

    def __init__(self, client: AsyncClient, seed: int) -> None:
        self.client = client
        self.tokens = token_ids(seed, TOKENS)
        self.hashes = prefix_hashes(self.tokens, BLOCK)
        self.request_id = f"prompt-{seed}"
        self.pages: dict[tuple[int, int], object] = {}

    async def put_pages(self) -> None:
        items = []
        for layer in ATTENTION:
            for block in range(4):
                page = kv_page(layer * 4 + block, BLOCK)
                key = self.client.kv_key(layer, self.hashes[block], block * BLOCK, (block + 1) * BLOCK)
                items.append(PutItem(key, page, request_id=self.request_id))
        for item, ref in zip(items, await self.client.put_many(items)):
            self.pages[(item.key.layer, item.key.token_start // BLOCK)] = ref

    async def put_snapshots(self, block: int, layers=SSM, *, tokens_absorbed: int | None = None) -> None:
        absorbed = (block + 1) * BLOCK if tokens_absorbed is None else tokens_absorbed
        items = [PutItem(self.client.ssm_key(layer, self.hashes[block], absorbed), snapshot(layer),
                         request_id=self.request_id) for layer in layers]
        await self.client.put_many(items)

    async def lookup(self) -> tuple[int, list[tuple[str, int, int]]]:
        found = await self.client.lookup(ATTENTION, SSM, token_ids=self.tokens)
        assert await self.client.release(found.lease_ids) == len(found.objects)
        return found.tokens, sorted((r.key.kind.name, r.key.layer, r.key.token_end) for r in found.refs)


def expected_objects(n: int) -> list[tuple[str, int, int]]:
    ssm = [("SSM", layer, n) for layer in SSM]
    kv = [("KV", layer, end) for layer in ATTENTION for end in range(BLOCK, n + 1, BLOCK)]
    return sorted(ssm + kv)


async def test_joint_hit_answers_the_largest_boundary_every_layer_can_restore(daemon) -> None:
    async with AsyncClient(daemon.url, namespace=jamba_namespace("joint-hit")) as client:
        prompt = JambaPrompt(client, seed=7)
        await prompt.put_pages()
        assert await prompt.lookup() == (0, [])  # KV everywhere, no snapshot: never a KV-only hit

        await prompt.put_snapshots(block=1)
        assert await prompt.lookup() == (128, expected_objects(128))

        await prompt.put_snapshots(block=3, layers=[layer for layer in SSM if layer != 13])
        assert (await prompt.lookup())[0] == 128  # layer 13 has no snapshot at 256

        await prompt.put_snapshots(block=3, layers=[13], tokens_absorbed=255)
        await prompt.put_snapshots(block=3, layers=[13], tokens_absorbed=257)
        assert (await prompt.lookup())[0] == 128  # off by one either way is no snapshot at 256

        await prompt.put_snapshots(block=3, layers=[13])
        await prompt.put_snapshots(block=2)
        assert await prompt.lookup() == (256, expected_objects(256))

        assert await client.delete(prompt.pages[(ATTENTION[1], 2)]) >= 1  # tokens [128, 192) of layer 29
        assert await prompt.lookup() == (128, expected_objects(128))


# -- fencing -------------------------------------------------------------------------------


async def test_a_superseded_version_is_stale(daemon) -> None:
    async with AsyncClient(daemon.url, namespace=jamba_namespace("stale")) as client:
        prefix = prefix_hashes(token_ids(2, 128), BLOCK)[-1]
        first = await client.put_ssm(3, prefix, 128, snapshot(1), request_id="stale-req")
        second = await client.put_ssm(3, prefix, 128, snapshot(2), request_id="stale-req")
        assert (first.version, second.version) == (1, 2) and first.state_id != second.state_id

        with pytest.raises(StaleState) as info:
            await client.load(first)
        assert info.value.reason == "stale"
        with pytest.raises(StaleState):
            await client.put_ssm(3, prefix, 128, snapshot(3), request_id="stale-req", version=2)
        assert_same_tensors(await client.load(second), snapshot(2))
        assert_same_tensors(await client.load(client.ssm_key(3, prefix, 128)), snapshot(2))  # by key: the newest


async def test_forged_refs_are_refused_with_the_reason_of_the_first_failed_check(daemon) -> None:
    spec = jamba_namespace("forged")
    hashes = prefix_hashes(token_ids(3, 256), BLOCK)
    async with AsyncClient(daemon.url, namespace=spec) as client, \
               AsyncClient(daemon.url, namespace=jamba_namespace("another-model")) as other_model:
        mine = await client.put_ssm(0, hashes[1], 128, snapshot(10), request_id="req-a")
        theirs = await client.put_ssm(0, hashes[1], 128, snapshot(11), request_id="req-b")
        layer1 = await client.put_ssm(1, hashes[1], 128, snapshot(12), request_id="req-a")
        later = await client.put_ssm(0, hashes[3], 256, snapshot(13), request_id="req-a")

        refusals = [
            (dataclasses.replace(mine, state_id=theirs.state_id), FingerprintMismatch),
            (dataclasses.replace(mine, state_id=layer1.state_id), PlacementMismatch),
            (dataclasses.replace(mine, state_id=later.state_id), PositionMismatch),
            (dataclasses.replace(mine, version=mine.version + 1), MisroutedState),
            (dataclasses.replace(mine, fingerprint=bytes(32)), FingerprintMismatch),
        ]
        for ref, error in refusals:
            with pytest.raises(error):
                await client.load(ref)
        with pytest.raises(NamespaceMismatch):
            await other_model.load(mine)

        for ref, seed in ((mine, 10), (theirs, 11), (layer1, 12), (later, 13)):
            assert_same_tensors(await client.load(ref), snapshot(seed))


# -- two nodes, one Redis ------------------------------------------------------------------


async def test_a_state_published_by_prefill_is_loaded_verified_by_decode(prefill, decode) -> None:
    spec = jamba_namespace("pd-handoff")
    prefix = prefix_hashes(token_ids(4, TOKENS), BLOCK)[-1]
    async with AsyncClient(prefill.url, namespace=spec) as producer, \
               AsyncClient(decode.url, namespace=spec) as consumer:
        items, wanted = jamba_items(producer, prefix, "pd-req", seed=100)
        refs = await producer.put_many([dataclasses.replace(item, publish=True) for item in items])

        before = decode.scrape()
        for ref, want in zip(refs, wanted):
            loaded_ref, tensors = await consumer.load_with_ref(ref)
            assert loaded_ref == ref
            assert_same_tensors(tensors, want)
        after = decode.scrape()
        assert after.delta(before, "statetier_hits_total", tier="redis", kind="ssm") == SSM_LAYERS
        assert after.delta(before, "statetier_hits_total", tier="redis", kind="kv") == ATTENTION_LAYERS
        assert after.delta(before, "statetier_promotions_total", src="redis", dst="host") == len(refs)

        for got, want in zip(await consumer.load_many(refs), wanted):  # now from decode's own arena
            assert_same_tensors(got, want)
        assert decode.scrape().delta(after, "statetier_hits_total", tier="host", kind="ssm") == SSM_LAYERS

        found = await consumer.lookup(ATTENTION, SSM, [(TOKENS, prefix)], kv_layout="prefix")
        await consumer.release(found.lease_ids)
        assert found.tokens == TOKENS


async def test_an_unpublished_state_stays_on_its_node(prefill, decode) -> None:
    spec = jamba_namespace("pd-local")
    async with AsyncClient(prefill.url, namespace=spec) as producer, \
               AsyncClient(decode.url, namespace=spec) as consumer:
        ref = await producer.put_ssm(0, bytes(32), 64, snapshot(5), request_id="local-req")
        with pytest.raises(NotFound):
            await consumer.load(ref)
        assert_same_tensors(await producer.load(ref), snapshot(5))


async def test_versions_are_fenced_across_nodes(prefill, decode) -> None:
    spec = jamba_namespace("pd-versions")
    prefix = prefix_hashes(token_ids(5, 128), BLOCK)[-1]
    async with AsyncClient(prefill.url, namespace=spec) as node_a, \
               AsyncClient(decode.url, namespace=spec) as node_b:
        v1 = await node_a.put_ssm(2, prefix, 128, snapshot(1), request_id="fence-req", publish=True)
        v2 = await node_a.put_ssm(2, prefix, 128, snapshot(2), request_id="fence-req", publish=True)
        assert (v1.version, v2.version) == (1, 2)

        for older in (1, 2):  # node B's late writes of versions node A has already superseded
            with pytest.raises(StaleState):
                await node_b.put_ssm(2, prefix, 128, snapshot(9), request_id="fence-req", version=older)
        with pytest.raises(StaleState):
            await node_b.load(v1)
        assert_same_tensors(await node_b.load(v2), snapshot(2))

        v3 = await node_b.put_ssm(2, prefix, 128, snapshot(3), request_id="fence-req", publish=True)
        assert v3.version == 3
        with pytest.raises(StaleState):
            await node_a.load(v2)  # node A still holds v2 locally; Redis knows v3
        assert_same_tensors(await node_a.load(v3), snapshot(3))
