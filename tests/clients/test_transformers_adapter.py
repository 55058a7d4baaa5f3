"""The transformers adapter against a real daemon (``statetier serve`` as a subprocess).

Tiny random-weight models (examples/tiny_hybrids.py) of every family transformers ships.
The story: a cache saved after prefill (one KV and one SSM group object) and restored into
a fresh ``DynamicCache`` gives the very same next-token logits (``torch.equal``); a state
missing a group is refused before anything is loaded; a group object of another layer set,
or a restore for other tokens, is refused by the daemon; the joint hit reports a boundary
only when every group has its object there; namespaces separate other weights, layouts
and dtypes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from examples.tiny_hybrids import ARCHITECTURES, build_model, prefill, prompt
from statetier.clients import AsyncClient, Client, LayerGroup
from statetier.clients.transformers import (
    SavedState,
    CHECKED_ON,
    LINEAR_COUNTER,
    cache_plan,
    forward_from,
    lookup_restorable,
    lookup_state,
    namespace_for,
    restore_cache,
    restore_cache_async,
    save_cache,
    save_cache_async,
    ssm_tensors,
    weights_fingerprint,
)
from statetier.launch import DaemonProcess
from statetier.protocol.errors import InvalidRequest, NotFound, PlacementMismatch, PositionMismatch
from statetier.protocol.identity import Kind

PROMPT_LEN = 20  # one full block of 16 and a partial one

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def daemon_url():
    with DaemonProcess(name="hf", host_capacity="64MiB", metrics=False) as daemon:
        yield daemon.url


_models: dict[str, torch.nn.Module] = {}


def model_of(arch: str) -> torch.nn.Module:
    if arch not in _models:
        _models[arch] = build_model(arch, seed=0)
    return _models[arch]


def prefilled(arch: str, seed: int):
    """``arch``'s model, ``prompt(seed, PROMPT_LEN)`` and the cache after it."""
    tokens = prompt(seed=seed, length=PROMPT_LEN)
    model = model_of(arch)
    cache, _ = prefill(model, tokens)
    return model, tokens, cache


def saved_request(url: str, arch: str, request_id: str, tokens: list[int]):
    model = model_of(arch)
    cache, first = prefill(model, tokens)
    with Client(url, namespace=namespace_for(model)) as client:
        saved = save_cache(client, model, cache, tokens, request_id=request_id)
    return model, cache, first, saved


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_restored_cache_gives_the_same_next_token_logits(daemon_url, arch):
    tokens = prompt(seed=1, length=PROMPT_LEN)
    model, cache, first, saved = saved_request(daemon_url, arch, f"rt-{arch}", tokens)
    plan = cache_plan(model.config)
    # one group object per kind: every attention layer's KV, every SSM layer's snapshot
    assert (saved.kv.key.group_layers if saved.kv else ()) == tuple(plan.attention_layers)
    assert (saved.ssm.key.group_layers if saved.ssm else ()) == tuple(plan.ssm_layers)
    assert saved.tokens == PROMPT_LEN and all(ref.key.token_end == PROMPT_LEN for ref in saved.refs())

    with Client(daemon_url, namespace=namespace_for(model)) as client:
        restored = restore_cache(client, model, SavedState.from_json(saved.to_json()), tokens)

    want = forward_from(model, cache, [first], PROMPT_LEN)
    got = forward_from(model, restored, [first], PROMPT_LEN)
    assert torch.equal(got, want)
    # and the next step too: the restored state evolves exactly like the original
    token = int(want.argmax())
    assert torch.equal(forward_from(model, restored, [token], PROMPT_LEN + 1),
                       forward_from(model, cache, [token], PROMPT_LEN + 1))


async def test_async_variants_round_trip(daemon_url):
    model = model_of("qwen3_next")
    tokens = prompt(seed=2, length=PROMPT_LEN)
    cache, first = prefill(model, tokens)
    async with AsyncClient(daemon_url, namespace=namespace_for(model)) as client:
        saved = await save_cache_async(client, model, cache, tokens, request_id="async-1")
        restored = await restore_cache_async(client, model, saved, tokens)
    assert torch.equal(forward_from(model, restored, [first], PROMPT_LEN),
                       forward_from(model, cache, [first], PROMPT_LEN))


def test_restore_from_a_lookup_releases_its_leases(daemon_url):
    tokens = prompt(seed=3, length=PROMPT_LEN)
    model, cache, first, _ = saved_request(daemon_url, "bamba", "lookup-1", tokens)
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        hit = lookup_state(client, model, tokens)
        assert hit.tokens == PROMPT_LEN and len(hit.lease_ids) == len(hit.refs) == 2  # a KV and an SSM group
        restored = restore_cache(client, model, hit, tokens)
        assert client.stats()["leases"] == 0
    assert torch.equal(forward_from(model, restored, [first], PROMPT_LEN),
                       forward_from(model, cache, [first], PROMPT_LEN))


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["ssm", "kv"])
def test_a_state_missing_one_group_is_refused_before_any_load(daemon_url, missing):
    tokens = prompt(seed=4, length=PROMPT_LEN)
    model, _, _, saved = saved_request(daemon_url, "jamba", f"partial-{missing}", tokens)
    layers = list(getattr(saved, missing).key.group_layers)
    partial = dataclasses.replace(saved, **{missing: None})
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        for ref in saved.refs():  # nothing loadable remains: a restore that tried would fail differently
            client.delete(ref)
        with pytest.raises(NotFound, match=rf"partial state refused: .*{missing.upper()} .*{layers}"):
            restore_cache(client, model, partial, tokens)


def test_a_group_object_of_another_layer_set_is_refused_with_the_placement_reason(daemon_url):
    tokens = prompt(seed=14, length=PROMPT_LEN)
    model, cache, _, saved = saved_request(daemon_url, "jamba", "layer-set", tokens)
    layers = saved.ssm.key.group_layers[1:]  # the same snapshots but one: another layer set
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        other = client.put_group(client.group_key(LayerGroup(Kind.SSM, 0, layers), saved.prefix_hash, 0, PROMPT_LEN),
                                 {layer: ssm_tensors(layer, cache.layers[layer], PROMPT_LEN) for layer in layers},
                                 request_id="layer-set")
        handed = dataclasses.replace(saved, ssm=dataclasses.replace(saved.ssm, state_id=other.state_id))
        with pytest.raises(PlacementMismatch):
            restore_cache(client, model, handed, tokens)


def test_a_restore_for_other_tokens_is_refused_by_the_daemon(daemon_url):
    tokens = prompt(seed=5, length=PROMPT_LEN)
    model, _, _, saved = saved_request(daemon_url, "mamba2", "other-tokens", tokens)
    other = [*tokens[:-1], (tokens[-1] + 1) % 90 + 3]
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        with pytest.raises(PositionMismatch):
            restore_cache(client, model, saved, other)
        with pytest.raises(PositionMismatch):
            restore_cache(client, model, saved, tokens[:-1])


def test_the_joint_hit_needs_every_layer(daemon_url):
    tokens = prompt(seed=6, length=PROMPT_LEN)
    model, _, _, saved = saved_request(daemon_url, "zamba2", "joint-1", tokens)
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        assert lookup_restorable(client, model, tokens) == PROMPT_LEN
        assert lookup_restorable(client, model, [*tokens, 5, 6, 7], candidates=[PROMPT_LEN]) == PROMPT_LEN
        assert lookup_restorable(client, model, [*tokens, 5, 6, 7]) == 0  # 20 is no block end
        assert lookup_restorable(client, model, prompt(seed=7, length=PROMPT_LEN)) == 0
        assert client.delete(saved.ssm) >= 1
        assert lookup_restorable(client, model, tokens) == 0  # KV pages alone are no hit


def test_a_client_made_for_another_model_is_refused(daemon_url):
    model, tokens, cache = prefilled("bamba", seed=8)
    with Client(daemon_url, namespace=namespace_for(model_of("granitemoehybrid"))) as client:
        with pytest.raises(InvalidRequest, match="not made by namespace_for"):
            save_cache(client, model, cache, tokens, request_id="wrong-ns")


def test_a_cache_layer_holding_unknown_tensors_is_not_saved(daemon_url):
    model, tokens, cache = prefilled("mamba2", seed=9)
    cache.layers[1].extra_state = torch.zeros(3)
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        with pytest.raises(InvalidRequest, match="extra_state"):
            save_cache(client, model, cache, tokens, request_id="unknown-tensor")


def test_a_cache_saved_under_other_tokens_is_refused(daemon_url):
    model, tokens, cache = prefilled("lfm2", seed=9)
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        with pytest.raises(PositionMismatch, match="attention layer .* absorbed 20 tokens, not 19"):
            save_cache(client, model, cache, tokens[:-1], request_id="wrong-length")


# -- the linear-attention token counter (transformers 5.25+) -------------------------------


def counters(cache) -> dict[int, int]:
    """``cumulative_length_linear`` of every layer that keeps one."""
    return {i: int(getattr(layer, LINEAR_COUNTER)) for i, layer in enumerate(cache.layers)
            if hasattr(layer, LINEAR_COUNTER)}


def transformers_release() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


#: 5.25 added the counter to every linear-attention layer; before it there is nothing to check.
keeps_counter = pytest.mark.skipif(transformers_release() < (5, 25),
                                   reason=f"transformers before 5.25 keeps no {LINEAR_COUNTER}")


@keeps_counter
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_linear_counter_is_restored_from_the_snapshot_position(daemon_url, arch):
    tokens = prompt(seed=21, length=PROMPT_LEN)
    model, cache, first, saved = saved_request(daemon_url, arch, f"counter-{arch}", tokens)
    ssm_layers = cache_plan(model.config).ssm_layers
    assert ssm_layers and sorted(counters(cache)) == ssm_layers  # every SSM layer counts, no other
    assert set(counters(cache).values()) == {PROMPT_LEN}
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        restored = restore_cache(client, model, saved, tokens)
    # set from the snapshot's tokens, not what the conv update counted (the kernel's width)
    assert counters(restored) == counters(cache)
    forward_from(model, restored, [first], PROMPT_LEN)
    forward_from(model, cache, [first], PROMPT_LEN)
    assert set(counters(restored).values()) == {PROMPT_LEN + 1} and counters(restored) == counters(cache)


@keeps_counter
@pytest.mark.parametrize("arch", ["mamba2", "zamba2", "qwen3_next"])
def test_a_linear_counter_that_disagrees_with_tokens_is_refused_with_the_position_reason(daemon_url, arch):
    model, tokens, cache = prefilled(arch, seed=22)
    layer = cache_plan(model.config).ssm_layers[-1]
    getattr(cache.layers[layer], LINEAR_COUNTER).add_(1)  # one token more than the state absorbed
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        with pytest.raises(PositionMismatch, match=rf"SSM layer {layer} absorbed {PROMPT_LEN + 1} tokens, "
                                                   rf"not {PROMPT_LEN}"):
            save_cache(client, model, cache, tokens, request_id=f"counter-off-{arch}")
        assert lookup_restorable(client, model, tokens) == 0  # refused before anything was stored


def test_an_unknown_tensor_is_refused_by_name_with_the_checked_releases(daemon_url):
    model, tokens, cache = prefilled("qwen3_next", seed=23)
    layer = next(i for i, p in enumerate(cache_plan(model.config).layers) if p.has_ssm)
    cache.layers[layer].cumulative_length_mamba = [torch.tensor(3)]  # a tensor a future release might add
    with Client(daemon_url, namespace=namespace_for(model)) as client:
        with pytest.raises(InvalidRequest, match=rf"'cumulative_length_mamba'.*{CHECKED_ON[-1]}"):
            save_cache(client, model, cache, tokens, request_id="unknown-list")


# -- identity ------------------------------------------------------------------------------


def test_namespaces_separate_weights_layouts_and_dtypes():
    base = namespace_for(build_model("bamba", seed=0)).namespace()
    assert namespace_for(build_model("bamba", seed=0)).namespace() == base  # same seed, another process alike
    others = [
        namespace_for(build_model("bamba", seed=1)),                      # other weights
        namespace_for(build_model("bamba", seed=0, mamba_d_state=16)),    # other state layout
        namespace_for(build_model("bamba", seed=0).to(torch.bfloat16)),   # other dtype
        namespace_for(build_model("bamba", seed=0), kv_block_size=32),    # other block size
    ]
    digests = {spec.namespace() for spec in others} | {base}
    assert len(digests) == 5


def test_the_weights_fingerprint_covers_every_tensor():
    model = build_model("mamba", seed=0)
    before = weights_fingerprint(model)
    twin = build_model("mamba", seed=0)
    with torch.no_grad():
        next(twin.parameters()).view(-1)[0] += 1e-3
    assert weights_fingerprint(twin) != before
    assert weights_fingerprint(build_model("mamba", seed=0)) == before


# -- the quirk table -----------------------------------------------------------------------


def test_restored_mamba1_state_continues_like_a_full_recompute():
    """Mamba-1 mixers ignore the state in multi-token forwards: forward_from feeds one by one."""
    model = model_of("mamba")
    tokens = prompt(seed=10, length=PROMPT_LEN)
    extra = [11, 12, 13]
    cache, _ = prefill(model, tokens)
    via_quirks = forward_from(model, cache, extra, PROMPT_LEN)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([tokens + extra])).logits[0, -1]
        cache2, _ = prefill(model, tokens)
        raw = model(input_ids=torch.tensor([extra]), cache=cache2, use_cache=True).logits[0, -1]
    assert torch.allclose(via_quirks, full, atol=1e-4)
    assert not torch.allclose(raw, full, atol=1e-2)  # the trap the table records
