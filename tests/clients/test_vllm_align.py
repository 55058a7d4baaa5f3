"""vLLM's Mamba "align" mode (prefix caching on a hybrid model) through the connector, against a
real daemon, without vLLM: the Mamba group holds one state block per block end; vLLM names the
exact block of each boundary state (``boundary_state_offloads``), the connector saves from that
block at that boundary, whatever the step's chunk size, and loads a hit's state into the block
vLLM allocated for that boundary. The same objects as in "none" mode: engines of either mode
share them.
"""

from __future__ import annotations

import pytest
import torch

from statetier.clients.vllm.layout import CacheGroup, EngineLayout, StateSpec, layer_id_of
from statetier.clients.vllm.scheduler import ScheduledStep
from statetier.protocol.identity import Kind
from tests.support.daemons import daemon_fixture
from tests.support.vllm_connector import (
    ATTN,
    BLOCK,
    CONV,
    HEAD,
    HEADS,
    MAMBA,
    RECURRENT,
    FakeRequest,
    hybrid_layout,
    report_saved,
    restore,
    tokens,
)


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, metrics=False, name="vllmalign")


def align_layout() -> EngineLayout:
    mamba = CacheGroup(0, Kind.SSM, BLOCK, tuple((n, layer_id_of(n)) for n in MAMBA),
                       (StateSpec("conv", "float32", CONV), StateSpec("recurrent", "float32", RECURRENT)),
                       is_aligned=True)
    attention = CacheGroup(1, Kind.KV, BLOCK, tuple((n, layer_id_of(n)) for n in ATTN),
                           (StateSpec("kv", "float32", (HEADS, HEAD)),))
    return EngineLayout((mamba, attention))


def boundary_state(engine, block: int, seed: int) -> dict:
    """What vLLM's kernel left in an align-mode state block at a boundary."""
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for name in MAMBA:
        for view in engine.worker.states(name, block).values():
            view.copy_(torch.randn(view.shape, generator=gen))
        written[name] = {k: v.clone() for k, v in engine.worker.states(name, block).items()}
    return written


def test_align_mode_saves_the_boundary_states_vllm_names_in_one_long_chunk_and_loads_them_by_position(
        engines) -> None:
    producer = engines(align_layout(), role="producer", seed=51)
    consumer = engines(align_layout(), role="consumer", seed=None)
    prompt = tokens(51, 40)
    request = FakeRequest("p-51", prompt)
    blocks = ([3, 4, 5], [1, 2, 6])  # Mamba: a state block per block end; attention: pages
    producer.scheduler.after_alloc(request, blocks, 0)
    at_16, at_32 = boundary_state(producer, 3, 1), boundary_state(producer, 4, 2)
    meta = producer.scheduler.build_meta([ScheduledStep(request, 0, 40, blocks)],  # one chunk of 40 tokens
                                         boundary_states={"p-51": [(0, 3, 16), (0, 4, 32), (0, 0, 48)]})
    assert sorted((i.group, i.key.kind, i.key.token_end, i.block_id) for job in meta.saves for i in job.items) == [
        (0, Kind.SSM, 16, 3), (0, Kind.SSM, 32, 4), (1, Kind.KV, 16, 1), (1, Kind.KV, 32, 2)]
    producer.worker.save(meta.saves)
    producer.worker.wait_idle()
    report_saved(producer)
    consumed = FakeRequest("c-51", prompt)
    assert restore(consumer, consumed, ([0, 7, 9], [5, 8, 10])) == 32  # block 0: vLLM's null block
    for name in MAMBA:  # the state at 32 in the block vLLM allocated for the boundary at 32
        assert all(torch.equal(consumer.worker.states(name, 8 - 1)[k], at_32[name][k]) for k in at_32[name])
        assert not consumer.worker.states(name, 9)["recurrent"].any()
    assert not torch.equal(at_16[MAMBA[0]]["recurrent"], at_32[MAMBA[0]]["recurrent"])
    _, params = producer.scheduler.request_finished(request)
    assert params["statetier"]["tokens"] == 32


def test_an_align_mode_engine_and_a_none_mode_engine_share_state(engines) -> None:
    producer = engines(align_layout(), role="producer", seed=52)
    consumer = engines(hybrid_layout(), role="consumer", seed=None)
    assert producer.scheduler.namespace == consumer.scheduler.namespace  # the mode is no part of the identity
    prompt = tokens(52, 40)
    request = FakeRequest("p-52", prompt)
    blocks = ([3, 4, 5], [1, 2, 6])
    producer.scheduler.after_alloc(request, blocks, 0)
    boundary_state(producer, 4, 3)
    meta = producer.scheduler.build_meta([ScheduledStep(request, 0, 40, blocks)],
                                         boundary_states={"p-52": [(0, 4, 32)]})
    producer.worker.save(meta.saves)
    producer.worker.wait_idle()
    other = FakeRequest("c-52", prompt)
    assert restore(consumer, other, ([2], [5, 7, 11])) == 32  # into the "none" engine's one slot
    for name in MAMBA:
        assert torch.equal(consumer.worker.states(name, 2)["recurrent"], producer.worker.states(name, 4)["recurrent"])
