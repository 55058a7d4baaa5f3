"""The vLLM connector's decode-token saves, ``reset_cache`` and counts, against a real daemon.

A producer with ``saves_decode`` keeps saving as its request decodes: every block the decoded
tokens complete (and the Mamba state at its end), so that a next turn whose prompt starts with
the whole conversation restores past the first prompt. ``reset_cache`` purges this namespace
and nothing else. The counts each side hands vLLM (``get_kv_connector_stats``) are exact:
lookups, hits and their tokens, misses by reason, objects and bytes per direction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.support.daemons import daemon_fixture
from tests.support.vllm_connector import (
    BLOCK, CONSUMER_BLOCKS, HEAD, HEADS, STATE_BYTES, FakeRequest, ask, prefill,
    restore, tokens)

from statetier.clients.vllm.metrics import summary
from statetier.clients.vllm.scheduler import ScheduledStep
from statetier.clients.vllm.stats import merge
from statetier.protocol.identity import Kind

BLOCKS = ([9], [1, 2, 3, 4, 6])


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, metrics=False, name="vllmcounts")


@dataclass
class DecodingRequest(FakeRequest):
    """A request as vLLM's: ``all_token_ids`` grows by one sampled token per decode step."""

    all_token_ids: list[int] = field(default_factory=list)


def decode(engine, request: DecodingRequest, continuation: list[int]) -> list:
    """Prefill, then one decode step per token of ``continuation`` (each its own step)."""
    request.all_token_ids = list(request.prompt_token_ids)
    metas = prefill(engine, request, BLOCKS, seed=31)
    for token in continuation:
        request.all_token_ids.append(token)  # sampled last step; its KV is computed in this one
        done = len(request.all_token_ids) - 1
        meta = engine.scheduler.build_meta([ScheduledStep(request, done, 1, BLOCKS)])
        engine.worker.save(meta.saves)
        metas.append(meta)
    engine.worker.wait_idle()
    return metas


@pytest.mark.parametrize("saves_decode", [True, False])
def test_decoded_tokens_are_saved_at_block_ends_for_the_next_turn(engines, saves_decode) -> None:
    producer = engines(role="producer", seed=31)
    producer.scheduler.saves_decode = saves_decode
    seed = 31 if saves_decode else 41  # the daemon is the module's: each case its own conversation
    prompt, continuation = tokens(seed, 40), tokens(seed + 1, 30)
    metas = decode(producer, DecodingRequest(f"p-{seed}", prompt), continuation)
    saved = sorted({(i.key.kind, i.key.token_end) for m in metas for job in m.saves for i in job.items})
    at_prompt = [(Kind.KV, 16), (Kind.KV, 32), (Kind.SSM, 16), (Kind.SSM, 32)]
    decoded = [(Kind.KV, 48), (Kind.KV, 64), (Kind.SSM, 48), (Kind.SSM, 64)]  # 40 + 30 tokens: blocks 3 and 4
    assert saved == sorted(at_prompt + (decoded if saves_decode else []))
    next_turn = FakeRequest(f"c-{seed}", prompt + continuation + tokens(seed + 2, 10))
    consumer = engines(role="consumer", seed=None)
    assert ask(consumer.scheduler, next_turn) == (64 if saves_decode else 32)


def test_reset_cache_purges_this_namespace_and_no_other(engines, daemon) -> None:
    producer = engines(role="producer", seed=34)
    other = engines(role="producer", seed=35, model="another-model")
    prompt = tokens(34, 40)
    prefill(producer, FakeRequest("p-34", prompt), BLOCKS, seed=34)
    prefill(other, FakeRequest("q-34", prompt), BLOCKS, seed=35)
    assert producer.scheduler.reset_cache() is True
    assert ask(engines(role="consumer", seed=None).scheduler, FakeRequest("c-34", prompt)) == 0
    assert ask(engines(role="consumer", seed=None, model="another-model").scheduler,
               FakeRequest("c-34b", prompt)) == 32


def test_the_counts_each_side_hands_vllm_are_exact(engines) -> None:
    producer, consumer = engines(role="producer", seed=36), engines(role="consumer", seed=None)
    prompt = tokens(36, 40)
    prefill(producer, FakeRequest("p-36", prompt), BLOCKS, seed=36)
    page_bytes = HEADS * BLOCK * 2 * HEAD * 4
    saved = producer.worker.counts.take()
    assert {k: v for k, v in saved.items() if not k.startswith("seconds.")} == {
        "objects.save": 4,  # 2 blocks of the attention group + the Mamba group at 16 and 32
        "bytes.save": 2 * 2 * page_bytes + 2 * 2 * STATE_BYTES}
    assert saved["seconds.save"] > 0
    assert restore(consumer, FakeRequest("c-36", prompt), CONSUMER_BLOCKS) == 32
    assert ask(consumer.scheduler, FakeRequest("c-36b", tokens(37, 40))) == 0
    assert consumer.scheduler.counts.take() == {"lookups": 2, "hits": 1, "hit_tokens": 32, "misses.none": 1}
    loaded = consumer.worker.counts.take()
    assert (loaded["objects.load"], loaded["bytes.load"]) == (3, 2 * 2 * page_bytes + 2 * STATE_BYTES)
    assert consumer.worker.counts.take() == {}  # taken: counted once
    both = merge(saved, loaded)
    assert summary(both)["objects_save"] == 4 and summary(both)["mb_load"] == round(loaded["bytes.load"] / 1e6, 3)
