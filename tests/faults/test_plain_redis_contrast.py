"""The contrast: the same mix-ups through plain Redis SET/GET decode other tokens, silently.

``PlainConnector`` is what a connector without statetier does: the prefill side SETs each
layer's tensors as raw bytes with redis-py (``plain:<run>:<request>:<kind>:<layer>:<name>``)
and hands over the keys with their shapes; the decode side GETs them into buffers of those
shapes (zeros where a key is missing, as a preallocated slot would be), fills a fresh
``DynamicCache`` with the adapter's own writers (``apply_kv`` / ``apply_ssm``) and
greedy-decodes. The genuine handoff decodes the reference, so the connector itself is right.

For every architecture, each mix-up the fault suite refuses (another request's snapshot, one
from k tokens earlier or one token off, the neighbouring layer's, KV without SSM state, a
late older version, a flipped bit, another model's state) decodes tokens that differ from
the reference, and no exception is raised: shapes and dtypes all fit. Everything is seeded,
so each outcome is the same on every run.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from examples.tiny_hybrids import greedy_decode, reference_tokens
from statetier.clients.transformers import apply_kv, apply_ssm, cache_plan, kv_tensors, new_cache, ssm_tensors
from tests.support.fault_harness import (
    ARCHS,
    K_EARLIER,
    NEW_TOKENS,
    PROMPT_LEN,
    flip_site,
    other_weights,
    prefilled,
    scenario,
)

RUN = uuid.uuid4().hex[:6]

pytestmark = [pytest.mark.parametrize("arch", ARCHS), pytest.mark.usefixtures("one_torch_thread")]


class PlainConnector:
    """Raw tensor bytes in Redis; a handoff is ``{"tokens": N, "entries": [[kind, layer, name, key, shape]]}``."""

    def __init__(self, redis) -> None:
        self.redis = redis

    def save(self, model, cache, tokens: int, request_id: str) -> dict:
        entries = []
        with self.redis.pipeline(transaction=False) as pipe:
            for plan in cache_plan(model.config).layers:
                layer = cache.layers[plan.index]
                parts = [("kv", kv_tensors(plan.index, layer, tokens))] if plan.has_kv else []
                parts += [("ssm", ssm_tensors(plan.index, layer, tokens))] if plan.has_ssm else []
                for kind, tensors in parts:
                    for name, tensor in tensors.items():
                        assert tensor.dtype == torch.float32
                        key = f"plain:{RUN}:{request_id}:{kind}:{plan.index}:{name}"
                        pipe.set(key, tensor.detach().contiguous().numpy().tobytes())
                        entries.append([kind, plan.index, name, key, list(tensor.shape)])
            pipe.execute()
        return {"tokens": tokens, "entries": entries}

    def restore(self, model, handoff: dict):
        handoff = json.loads(json.dumps(handoff))  # it crossed a process boundary
        plan = cache_plan(model.config)
        cache = new_cache(model.config)
        raws = self.redis.mget([entry[3] for entry in handoff["entries"]])
        grouped: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        for (kind, layer, name, _key, shape), raw in zip(handoff["entries"], raws):
            buffer = torch.zeros(shape, dtype=torch.float32)
            if raw is not None:
                buffer.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            grouped.setdefault((kind, layer), {})[name] = buffer
        for (kind, layer), tensors in grouped.items():
            if kind == "kv":
                apply_kv(plan.layer(layer), cache.layers[layer], tensors, handoff["tokens"])
            else:
                apply_ssm(plan.layer(layer), cache.layers[layer], tensors, handoff["tokens"])
        return cache


@pytest.fixture(scope="module")
def plain(plain_redis) -> PlainConnector:
    return PlainConnector(plain_redis)


def save(plain: PlainConnector, model, tokens: list[int], request_id: str) -> dict:
    cache, _ = prefilled(model, tokens)
    return plain.save(model, cache, len(tokens), request_id)


def decode(plain: PlainConnector, model, handoff: dict, first: int) -> list[int]:
    """The decode worker on the plain path: whatever the bytes are, it decodes."""
    cache = plain.restore(model, handoff)
    return greedy_decode(model, cache, first, handoff["tokens"], NEW_TOKENS)


def ssm_keys(handoff: dict, layer: int) -> dict[str, str]:
    return {name: key for kind, at, name, key, _ in handoff["entries"] if kind == "ssm" and at == layer}


def with_ssm_keys(handoff: dict, layer: int, keys: dict[str, str]) -> dict:
    """The handoff with ``layer``'s SSM keys pointing elsewhere (same names, same shapes)."""
    entries = [[kind, at, name, keys[name] if kind == "ssm" and at == layer else key, shape]
               for kind, at, name, key, shape in handoff["entries"]]
    return {**handoff, "entries": entries}


def assert_silently_wrong(tokens: list[int], reference: list[int]) -> None:
    assert len(tokens) == NEW_TOKENS and tokens != reference, tokens


def test_the_genuine_plain_handoff_decodes_the_reference(plain, arch):
    sc = scenario(arch)
    handoff = save(plain, sc.model, sc.prompt, f"{arch}-genuine")
    assert decode(plain, sc.model, handoff, sc.first) == sc.reference


def test_another_requests_snapshot_decodes_other_tokens(plain, arch):
    sc = scenario(arch)
    mine = save(plain, sc.model, sc.prompt, f"{arch}-mine")
    theirs = save(plain, sc.model, sc.other_prompt, f"{arch}-theirs")
    bad = with_ssm_keys(mine, sc.target, ssm_keys(theirs, sc.target))
    assert_silently_wrong(decode(plain, sc.model, bad, sc.first), sc.reference)


@pytest.mark.parametrize("offset", [-K_EARLIER, -1, +1])
def test_a_snapshot_from_another_position_decodes_other_tokens(plain, arch, offset):
    sc = scenario(arch)
    mine = save(plain, sc.model, sc.prompt, f"{arch}-pos")
    tokens = sc.prompt[:offset] if offset < 0 else [*sc.prompt, sc.first]
    off = save(plain, sc.model, tokens, f"{arch}-pos{offset:+d}")
    assert len(tokens) == PROMPT_LEN + offset
    bad = with_ssm_keys(mine, sc.target, ssm_keys(off, sc.target))
    assert_silently_wrong(decode(plain, sc.model, bad, sc.first), sc.reference)


def test_the_neighbouring_layers_snapshot_decodes_other_tokens(plain, arch):
    sc = scenario(arch)
    mine = save(plain, sc.model, sc.prompt, f"{arch}-layers")
    bad = with_ssm_keys(mine, sc.target, ssm_keys(mine, sc.neighbour))
    assert_silently_wrong(decode(plain, sc.model, bad, sc.first), sc.reference)


@pytest.mark.parametrize("missing", ["one", "all"])
def test_kv_without_ssm_state_decodes_other_tokens(plain, plain_redis, arch, missing):
    sc = scenario(arch)
    handoff = save(plain, sc.model, sc.prompt, f"{arch}-missing-{missing}")
    layers = [sc.target] if missing == "one" else sc.plan.ssm_layers
    plain_redis.delete(*[key for layer in layers for key in ssm_keys(handoff, layer).values()])
    assert_silently_wrong(decode(plain, sc.model, handoff, sc.first), sc.reference)


def test_a_late_older_version_decodes_other_tokens(plain, plain_redis, arch):
    sc = scenario(arch)
    request_id = f"{arch}-versions"
    # Attempt 1 (over other tokens, as in the fault suite); a second path still holds its bytes.
    first = save(plain, sc.model, sc.other_prompt, request_id)
    in_flight = {name: plain_redis.get(key) for name, key in ssm_keys(first, sc.target).items()}
    handoff = save(plain, sc.model, sc.prompt, request_id)  # attempt 2: the same keys, overwritten
    for name, key in ssm_keys(handoff, sc.target).items():  # attempt 1's late write lands last
        plain_redis.set(key, in_flight[name])
    assert_silently_wrong(decode(plain, sc.model, handoff, sc.first), sc.reference)


def test_a_flipped_bit_decodes_other_tokens(plain, plain_redis, arch):
    sc = scenario(arch)
    handoff = save(plain, sc.model, sc.prompt, f"{arch}-bit")
    cache, _ = prefilled(sc.model, sc.prompt)
    name, byte, mask = flip_site(ssm_tensors(sc.target, cache.layers[sc.target], len(sc.prompt)))
    key = ssm_keys(handoff, sc.target)[name]
    old = plain_redis.getrange(key, byte, byte)
    plain_redis.setrange(key, byte, bytes([old[0] ^ mask]))
    assert_silently_wrong(decode(plain, sc.model, handoff, sc.first), sc.reference)


def test_another_models_state_decodes_other_tokens(plain, arch):
    sc = scenario(arch)
    handoff = save(plain, sc.model, sc.prompt, f"{arch}-model")
    theirs = other_weights(arch)
    tokens = decode(plain, theirs, handoff, sc.first)
    assert_silently_wrong(tokens, reference_tokens(theirs, sc.prompt, NEW_TOKENS))  # what that worker would say
    assert tokens != sc.reference
