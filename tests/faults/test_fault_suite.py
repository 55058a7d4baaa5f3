"""Issue 5, item 3: every mix-up of the PD handoff is a typed rejection, counted, never tokens.

The pipeline: two ``statetier serve`` processes (prefill node, decode node) sharing one
``redis-server`` and one keyring; a tiny random-weight hybrid model per architecture
(Jamba, Bamba, Zamba2, Qwen3-Next, Mamba2). The prefill side saves its cache with
``save_cache(…, publish=True)`` (a KV and an SSM group object) and hands
``SavedState.to_json()`` over; the decode side restores it on its own daemon
(``restore_cache``, one load at a time so the counts are exact) and greedy-decodes. The
genuine handoff decodes the reference tokens. The mix-ups swap the SSM group object's ref.

Each fault then asserts three things: the restore raises exactly the error class DESIGN §4
gives (``type(exc) is X``); the decode daemon's ``statetier_rejections_total{reason}`` moved
by exactly one and no other reason or miss moved (for the joint-hit miss: the lookup
answered 0 and no load ran); and the decode model ran no forward. The faults, in issue order:
another request's snapshot; a snapshot k tokens early or one token off either way; the
same snapshots stored as another layer group; KV without SSM state; an older version after a newer one;
a state_id of another transfer; a flipped bit in Redis and on disk; a header re-signed
without the key; a decoder whose model has other weights; and (issue 12) another object's
intact bytes written under this object's key, in Redis (with and without its manifest) and
in the host arena: the identity reason, never ``CorruptPayload``, no damage counted, the
copy left in place for ``statetier inspect``, and a genuine copy elsewhere still served.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

import pytest

from examples.tiny_hybrids import greedy_decode, prompt
from statetier.clients import Client, LayerGroup
from statetier.clients.transformers import (
    SavedState,
    groups_of,
    lookup_state,
    namespace_for,
    put_items,
    restore_cache,
    save_cache,
    ssm_tensors,
)
from statetier.protocol.errors import (
    BadSignature,
    CorruptPayload,
    FingerprintMismatch,
    MisroutedState,
    NamespaceMismatch,
    NotFound,
    PlacementMismatch,
    PositionMismatch,
    StaleState,
    StatetierError,
)
from statetier.protocol.identity import Kind, prefix_hash
from statetier.protocol.keyring import Keyring, SigningKey
from statetier.protocol.sealed import Expectation, decode_header, open_sealed
from tests.support.fault_harness import (
    ARCHS,
    K_EARLIER,
    NEW_TOKENS,
    PROMPT_LEN,
    Counters,
    ForwardCounter,
    changes,
    flip_disk_bit,
    flip_redis_bit,
    flip_site,
    forged_blob,
    is_in_redis,
    other_weights,
    overwrite_in_arena,
    payload_offset,
    prefilled,
    redis_blob,
    scenario,
    write_redis_blob,
    write_under_another_key,
)

RUN = uuid.uuid4().hex[:6]  # request ids of this run (the session's Redis outlives a module)

pytestmark = [pytest.mark.parametrize("arch", ARCHS), pytest.mark.usefixtures("one_torch_thread")]


# -- the two sides -------------------------------------------------------------------------


def publish(nodes, model, tokens: list[int], request_id: str) -> SavedState:
    """The prefill worker: prefill ``tokens``, save with publish (host + Redis), hand the refs over."""
    cache, _ = prefilled(model, tokens)
    with Client(nodes.prefill.url, namespace=namespace_for(model)) as client:
        return save_cache(client, model, cache, tokens, request_id=request_id, publish=True)


def decode_side(nodes, model, handoff: SavedState, tokens: list[int], first: int) -> list[int]:
    """The decode worker: restore the handed state on its own daemon, then greedy-decode."""
    received = SavedState.from_json(handoff.to_json())
    # One load at a time: the first refusal ends the restore before another load is sent,
    # so the daemon counts exactly one rejection even when every ref is bad.
    with Client(nodes.decode.url, namespace=namespace_for(model), concurrency=1) as client:
        cache = restore_cache(client, model, received, tokens)
    return greedy_decode(model, cache, first, len(tokens), NEW_TOKENS)


def with_ssm(saved: SavedState, ref) -> SavedState:
    """The handoff with its SSM group object's ref replaced (what a mixed-up connector delivers)."""
    return dataclasses.replace(saved, ssm=ref)


def publish_as_other_group(nodes, sc, request_id: str):
    """The very snapshots of the prompt published as group 1 of the same layers (the adapter
    stores group 0): another group's object, of the same size when ``request_id`` has the
    same length as the genuine one's."""
    cache, _ = prefilled(sc.model, sc.prompt)
    layers = groups_of(sc.plan)[Kind.SSM].layers
    with Client(nodes.prefill.url, namespace=namespace_for(sc.model)) as client:
        prefix = prefix_hash(sc.prompt, block_size=client.spec.kv_block_size)
        key = client.group_key(LayerGroup(Kind.SSM, 1, layers), prefix, 0, len(sc.prompt))
        return client.put_group(key, {layer: ssm_tensors(layer, cache.layers[layer], len(sc.prompt)) for layer in layers},
                                request_id=request_id, publish=True)


def assert_refused(nodes, model, handoff: SavedState, tokens: list[int], first: int, error: type) -> None:
    """The restore raises exactly ``error``, counted once by its reason, before any forward."""
    before = Counters.of(nodes.decode)
    decoded = None
    with ForwardCounter(model) as forwards, pytest.raises(StatetierError) as info:
        decoded = decode_side(nodes, model, handoff, tokens, first)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert decoded is None and forwards.calls == 0
    after = Counters.of(nodes.decode)
    assert changes(before, after, "rejected:", "miss:") == {f"rejected:{error.reason}": 1}


class Handoffs:
    """Genuine handoffs published once per (architecture, name) and shared by the tests."""

    def __init__(self, nodes) -> None:
        self.nodes, self._saved = nodes, {}

    def get(self, arch: str, name: str) -> SavedState:
        if (arch, name) not in self._saved:
            sc = scenario(arch)
            tokens, request = {
                "main": (sc.prompt, "main"),
                "other_prompt": (sc.other_prompt, "other"),  # another request, same length
                "same_prompt": (sc.prompt, "twin"),  # another request, the very same tokens
                f"earlier_{K_EARLIER}": (sc.prompt[:-K_EARLIER], "main"),  # this request, k tokens before
                "earlier_1": (sc.prompt[:-1], "main"),
                "later_1": ([*sc.prompt, sc.first], "main"),  # this request, one token past
            }[name]
            self._saved[arch, name] = publish(self.nodes, sc.model, tokens, f"{RUN}-{arch}-{request}")
        return self._saved[arch, name]


@pytest.fixture(scope="module")
def handoffs(pd_nodes) -> Handoffs:
    return Handoffs(pd_nodes)


# -- the control ---------------------------------------------------------------------------


def test_the_genuine_handoff_decodes_the_reference_tokens(pd_nodes, handoffs, arch):
    sc = scenario(arch)
    before = Counters.of(pd_nodes.decode)
    tokens = decode_side(pd_nodes, sc.model, handoffs.get(arch, "main"), sc.prompt, sc.first)
    assert tokens == sc.reference
    moved = changes(before, Counters.of(pd_nodes.decode))
    objects = len(groups_of(sc.plan))  # one group object per kind, every layer in it
    assert moved == {"loads": objects, "hits": objects}  # every object verified, nothing refused


# -- 1. another request's snapshot ---------------------------------------------------------


@pytest.mark.parametrize("source, error", [
    ("other_prompt", PositionMismatch),  # its prefix hash is another prompt's
    ("same_prompt", FingerprintMismatch),  # same tokens: the by-ref load binds the request id
])
def test_another_requests_snapshot_is_refused(pd_nodes, handoffs, arch, source, error):
    sc = scenario(arch)
    theirs = handoffs.get(arch, source).ssm
    assert theirs.key.token_end == PROMPT_LEN  # same layers, same length: the same shapes
    bad = with_ssm(handoffs.get(arch, "main"), theirs)
    assert_refused(pd_nodes, sc.model, bad, sc.prompt, sc.first, error)


# -- 2. a snapshot from another position ---------------------------------------------------


@pytest.mark.parametrize("source", [f"earlier_{K_EARLIER}", "earlier_1", "later_1"])
def test_a_snapshot_from_another_position_is_refused(pd_nodes, handoffs, arch, source):
    sc = scenario(arch)
    off = handoffs.get(arch, source).ssm
    assert off.key.token_end != PROMPT_LEN
    bad = with_ssm(handoffs.get(arch, "main"), off)
    assert_refused(pd_nodes, sc.model, bad, sc.prompt, sc.first, PositionMismatch)


# -- 3. the same snapshots stored as another layer group -----------------------------------


def test_another_groups_object_is_refused(pd_nodes, handoffs, arch):
    sc = scenario(arch)
    main = handoffs.get(arch, "main")
    other = publish_as_other_group(pd_nodes, sc, f"{RUN}-{arch}-main")  # group 1, same bytes
    bad = with_ssm(main, other)
    assert_refused(pd_nodes, sc.model, bad, sc.prompt, sc.first, PlacementMismatch)


# -- 4. KV pages without their SSM snapshots -----------------------------------------------


def _kv_only(nodes, sc, tokens: list[int], request_id: str) -> SavedState:
    """Every attention layer saved and published, no SSM snapshot ever (an SSM-blind connector)."""
    cache, _ = prefilled(sc.model, tokens)
    spec = namespace_for(sc.model)
    with Client(nodes.prefill.url, namespace=spec) as client:
        items = [item for item in put_items(client.namespace, spec, sc.plan, cache, tokens,
                                            request_id=request_id, publish=True) if item.key.kind is Kind.KV]
        refs = client.put_many(items) if items else []  # Mamba2 has no attention layer
    kv = refs[0] if refs else None
    return SavedState(len(tokens), prefix_hash(tokens, block_size=spec.kv_block_size), kv, None, request_id, 0)


@pytest.mark.parametrize("missing", ["one", "all"])
def test_kv_pages_without_ssm_snapshots_are_no_hit(pd_nodes, arch, missing):
    sc = scenario(arch)
    # A prompt no other test saved: the joint hit is by prefix, whoever's objects they are.
    tokens = prompt(seed={"one": 11, "all": 12}[missing], length=PROMPT_LEN)
    request_id = f"{RUN}-{arch}-kv-only-{missing}"
    if missing == "one":
        handoff = publish(pd_nodes, sc.model, tokens, request_id)
        deleted = 0
        for daemon in (pd_nodes.prefill, pd_nodes.decode):  # every copy: host, disk, Redis
            with Client(daemon.url, namespace=namespace_for(sc.model)) as client:
                deleted += client.delete(handoff.ssm)
        assert deleted >= 1 and not is_in_redis(pd_nodes.redis, handoff.ssm.state_id)
    else:
        handoff = _kv_only(pd_nodes, sc, tokens, request_id)

    before = Counters.of(pd_nodes.decode)
    with ForwardCounter(sc.model) as forwards, \
            Client(pd_nodes.decode.url, namespace=namespace_for(sc.model), concurrency=1) as client:
        hit = lookup_state(client, sc.model, tokens)
        assert hit.tokens == 0 and hit.refs == []  # never a KV-only hit
        with pytest.raises(StatetierError) as from_lookup:
            restore_cache(client, sc.model, hit, tokens)
        if missing == "all":  # the handed refs name no SSM group: refused before any load
            with pytest.raises(StatetierError) as from_refs:
                restore_cache(client, sc.model, SavedState.from_json(handoff.to_json()), tokens)
            assert type(from_refs.value) is NotFound and "partial state refused" in str(from_refs.value)
    assert type(from_lookup.value) is NotFound
    assert forwards.calls == 0
    assert changes(before, Counters.of(pd_nodes.decode)) == {"lookups": 1}  # answered 0 tokens, loaded nothing


# -- 5. an older version after a newer one -------------------------------------------------


def _two_attempts(nodes, sc, request_id: str) -> tuple[SavedState, SavedState]:
    """Two attempts at the same streams: version 1 over ``other_prompt``, then version 2 over the
    prompt. A stream is (namespace, request, kind, layer, shard, span): the prefix hash is left
    out (DESIGN §2), so a recompute over other tokens still supersedes the first attempt."""
    first = publish(nodes, sc.model, sc.other_prompt, request_id)
    second = publish(nodes, sc.model, sc.prompt, request_id)
    assert {r.version for r in first.refs()} == {1} and {r.version for r in second.refs()} == {2}
    return first, second


def test_an_older_version_after_a_newer_one_is_stale(pd_nodes, arch):
    sc = scenario(arch)
    request_id = f"{RUN}-{arch}-versions"
    first, second = _two_attempts(pd_nodes, sc, request_id)
    old_cache, _ = prefilled(sc.model, sc.other_prompt)

    # the second connector path: a late write-behind replays version 1 through the decode node
    before = Counters.of(pd_nodes.decode)
    with Client(pd_nodes.decode.url, namespace=namespace_for(sc.model)) as client, \
            pytest.raises(StatetierError) as replay:
        client.put_group(first.ssm.key, {layer: ssm_tensors(layer, old_cache.layers[layer], len(sc.other_prompt))
                                         for layer in first.ssm.key.group_layers},
                         request_id=request_id, version=1, publish=True)
    assert type(replay.value) is StaleState
    assert changes(before, Counters.of(pd_nodes.decode), "rejected:", "miss:") == {"rejected:stale": 1}

    # the version-1 handoff arrives after version 2 exists
    assert_refused(pd_nodes, sc.model, first, sc.other_prompt, sc.first, StaleState)


# -- 6. a state_id that belongs to another transfer ----------------------------------------


@pytest.mark.parametrize("transfer, error", [
    # The key fields are this request's, the state_id another request's transfer of the same
    # tokens and layer. The daemon finds that object; its fingerprint (which binds the request
    # id) fails check 7, which DESIGN §4 runs before the registry's stream check of step 8.
    ("another_request", FingerprintMismatch),
    # The newer attempt's state_id under this attempt's version: the registry issued it for
    # this very stream, but as version 2; a state_id presented with another version is
    # misrouted (docs/protocol.md, check 8).
    ("another_attempt", MisroutedState),
])
def test_a_state_id_of_another_transfer_is_refused(pd_nodes, handoffs, arch, transfer, error):
    sc = scenario(arch)
    if transfer == "another_request":
        handoff = handoffs.get(arch, "main")
        theirs = handoffs.get(arch, "same_prompt").ssm
        bad = with_ssm(handoff, dataclasses.replace(handoff.ssm, state_id=theirs.state_id))
    else:
        first, second = _two_attempts(pd_nodes, sc, f"{RUN}-{arch}-attempts")
        bad = with_ssm(second, dataclasses.replace(second.ssm, version=first.ssm.version))
    assert_refused(pd_nodes, sc.model, bad, sc.prompt, sc.first, error)


# -- 7. one flipped bit in a stored payload ------------------------------------------------


def test_a_flipped_bit_in_redis_is_corrupt(pd_nodes, arch):
    sc = scenario(arch)
    handoff = publish(pd_nodes, sc.model, sc.prompt, f"{RUN}-{arch}-redis-bit")
    cache, _ = prefilled(sc.model, sc.prompt)
    damaged = handoff.ssm.state_id
    flip_redis_bit(pd_nodes.redis, damaged, ssm_tensors(sc.target, cache.layers[sc.target], len(sc.prompt)), sc.target)
    assert_refused(pd_nodes, sc.model, handoff, sc.prompt, sc.first, CorruptPayload)
    assert not is_in_redis(pd_nodes.redis, damaged)  # a copy failing an integrity check is removed
    # the decode daemon did not digest it (its client verifies where the bytes land) and
    # promoted it into its arena; the client's recheck dropped that copy too
    with Client(pd_nodes.decode.url) as client, pytest.raises(NotFound):
        client.inspect(damaged)


def test_a_flipped_bit_in_the_arena_is_dropped_and_the_published_copy_served(pd_nodes, arch):
    sc = scenario(arch)
    handoff = publish(pd_nodes, sc.model, sc.prompt, f"{RUN}-{arch}-arena-bit")
    cache, _ = prefilled(sc.model, sc.prompt)
    target = handoff.ssm.state_id
    blob = bytearray(redis_blob(pd_nodes.redis, target))
    name, byte, mask = flip_site(ssm_tensors(sc.target, cache.layers[sc.target], len(sc.prompt)), sc.target)
    blob[payload_offset(bytes(blob), name) + byte] ^= mask
    overwrite_in_arena(pd_nodes.prefill, handoff.ssm, bytes(blob))
    with Client(pd_nodes.prefill.url, namespace=namespace_for(sc.model)) as client:
        before = Counters.of(pd_nodes.prefill)
        with ForwardCounter(sc.model) as forwards:
            restored = restore_cache(client, sc.model, SavedState.from_json(handoff.to_json()), sc.prompt)
        assert forwards.calls == 0
        # found where it landed, never handed to the model; the recheck dropped the arena copy
        # (counted once) and served an intact one, promoted again: the published one, or its
        # disk copy once the write-behind made it (published puts are written behind too)
        assert changes(before, Counters.of(pd_nodes.prefill), "rejected:", "miss:") == \
            {"rejected:corrupt_payload": 1}
        assert greedy_decode(sc.model, restored, sc.first, len(sc.prompt), NEW_TOKENS) == sc.reference
        assert client.inspect(target)["tiers"] in (["host", "redis"], ["host", "disk", "redis"])
    assert is_in_redis(pd_nodes.redis, target)


@pytest.fixture(scope="module")
def on_decode_disk(pd_nodes) -> dict[str, SavedState]:
    """Per architecture, a state whose only copy is on the decode node's disk.

    The decode node saves it itself without publishing (host arena, then write-behind to
    disk; nothing in Redis), then restarts: the arena is volatile, the disk tier is not.
    """
    saved = {}
    for arch in ARCHS:
        sc = scenario(arch)
        cache, _ = prefilled(sc.model, sc.prompt)
        with Client(pd_nodes.decode.url, namespace=namespace_for(sc.model)) as client:
            saved[arch] = save_cache(client, sc.model, cache, sc.prompt, request_id=f"{RUN}-{arch}-disk-bit")
    pd_nodes.decode.restart()  # SIGTERM flushes the write-behind queue first
    with Client(pd_nodes.decode.url) as client:
        for state in saved.values():
            assert all(client.inspect(ref.state_id)["tiers"] == ["disk"] for ref in state.refs())
    return saved


def test_a_flipped_bit_on_disk_is_corrupt(pd_nodes, on_decode_disk, arch):
    sc = scenario(arch)
    handoff = on_decode_disk[arch]
    cache, _ = prefilled(sc.model, sc.prompt)
    flip_disk_bit(pd_nodes.decode.disk_dir, handoff.ssm.state_id,
                  ssm_tensors(sc.target, cache.layers[sc.target], len(sc.prompt)), sc.target)
    assert_refused(pd_nodes, sc.model, handoff, sc.prompt, sc.first, CorruptPayload)
    with Client(pd_nodes.decode.url) as client, pytest.raises(NotFound):  # dropped, promoted copy too
        client.inspect(handoff.ssm.state_id)


# -- 8. a header rewritten by a writer without the key -------------------------------------


def test_a_header_rewritten_without_the_key_is_a_bad_signature(pd_nodes, arch):
    sc = scenario(arch)
    handoff = publish(pd_nodes, sc.model, sc.prompt, f"{RUN}-{arch}-forged")
    other = publish(pd_nodes, sc.model, sc.other_prompt, f"{RUN}-{arch}-source")
    # The forger knows the key id (every header carries it), not the secret.
    key_id = pd_nodes.keyring.active.key_id
    forger = Keyring([SigningKey.from_secret(key_id, os.urandom(32))], key_id)
    target = handoff.ssm.state_id
    genuine = redis_blob(pd_nodes.redis, target)
    forged = forged_blob(genuine, redis_blob(pd_nodes.redis, other.ssm.state_id), forger)
    assert forged != genuine and len(forged) == len(genuine)
    # Under the forger's own key it is a perfect match for the handed ref: only the signature tells.
    expected = decode_header(genuine).ref()
    assert open_sealed(forged, Expectation.for_ref(expected, expected.key.namespace), forger).header.ref() == expected
    write_redis_blob(pd_nodes.redis, target, forged)
    assert_refused(pd_nodes, sc.model, handoff, sc.prompt, sc.first, BadSignature)
    assert not is_in_redis(pd_nodes.redis, target)


# -- 9. a snapshot from a different model --------------------------------------------------


def test_a_decoder_with_other_weights_is_refused(pd_nodes, handoffs, arch):
    sc = scenario(arch)
    theirs = other_weights(arch)
    assert namespace_for(theirs).namespace() != namespace_for(sc.model).namespace()
    assert_refused(pd_nodes, theirs, handoffs.get(arch, "main"), sc.prompt, sc.first, NamespaceMismatch)


# -- 10. another object's bytes under this object's key ------------------------------------


@pytest.mark.parametrize("with_manifest", [False, True], ids=["chunk-only", "manifest-too"])
@pytest.mark.parametrize("source, error", [
    ("other_group", PlacementMismatch),  # the same snapshots stored as another layer group
    ("other_prompt", PositionMismatch),  # another request's, over other tokens
    ("same_prompt", FingerprintMismatch),  # another request's, over the same tokens
    ("earlier_1", PositionMismatch),  # this request's, one token early
])
def test_another_objects_bytes_under_this_key_in_redis_get_the_identity_reason(pd_nodes, handoffs, arch, source,
                                                                              error, with_manifest):
    sc = scenario(arch)
    request_id = f"{RUN}-{arch}-wrong-key-{source}-{int(with_manifest)}"
    handoff = publish(pd_nodes, sc.model, sc.prompt, request_id)
    target = handoff.ssm.state_id
    theirs = (publish_as_other_group(pd_nodes, sc, request_id) if source == "other_group"
              else handoffs.get(arch, source).ssm)
    write_under_another_key(pd_nodes.redis, target, theirs.state_id, with_manifest=with_manifest)
    assert_refused(pd_nodes, sc.model, handoff, sc.prompt, sc.first, error)  # that reason alone: no corrupt_payload
    assert is_in_redis(pd_nodes.redis, target)  # no damage: left in place
    with Client(pd_nodes.decode.url, namespace=namespace_for(sc.model)) as client:
        found = client.inspect(target)["header"]  # what the operator sees: the object it really is
    assert found["state_id"] == theirs.state_id.hex()


def test_another_objects_bytes_in_the_arena_leave_the_genuine_copy_served(pd_nodes, arch):
    sc = scenario(arch)
    request_id = f"{RUN}-{arch}-wrong-key-arena"
    handoff = publish(pd_nodes, sc.model, sc.prompt, request_id)
    target, other = handoff.ssm, publish_as_other_group(pd_nodes, sc, request_id)
    with Client(pd_nodes.prefill.url, namespace=namespace_for(sc.model)) as client:
        overwrite_in_arena(pd_nodes.prefill, target, redis_blob(pd_nodes.redis, other.state_id))
        before = Counters.of(pd_nodes.prefill)
        with ForwardCounter(sc.model):
            cache = restore_cache(client, sc.model, SavedState.from_json(handoff.to_json()), sc.prompt)
        # the arena copy is refused as the other group's; the published copy in Redis is served
        assert changes(before, Counters.of(pd_nodes.prefill), "rejected:", "miss:") == {"rejected:placement": 1}
        assert greedy_decode(sc.model, cache, sc.first, len(sc.prompt), NEW_TOKENS) == sc.reference
        described = client.inspect(target.state_id)
    assert described["tiers"][0] == "host" and described["header"]["layer"] == 1  # group 1: left for forensics
