"""The vLLM connector's ``take_events()`` against a real daemon's KV event stream, without vLLM.

A producer's scheduler side saves a prompt's blocks (two attention layers: two objects per
block); what ``take_events()`` then returns is the daemon's events of exactly those blocks,
renamed to vLLM's block hashes with their parents and tokens, per medium and in order: stored
in host memory (``CPU``), copied to disk (``DISK``), and removed from both by a delete. A block
of the same namespace the connector never saved, and everything of another namespace on the
same daemon, are not passed on. The subscription is the connector's own (``connector_events``):
the topic of the namespace the daemon owns for the connection's tenant, which the scheduler side's
connection tells. vLLM's own event classes are built from them when vLLM is here.
"""

from __future__ import annotations

from types import SimpleNamespace

from dataclasses import dataclass, field

import pytest
import torch

from statetier.clients import Client
from statetier.clients.vllm.connector import connector_events
from statetier.clients.vllm.events import as_vllm_events
from statetier.clients.vllm.layout import (
    CacheGroup,
    ConnectorConfig,
    EngineLayout,
    StateSpec,
    layer_id_of,
    namespace_spec,
)
from statetier.clients.vllm.scheduler import ScheduledStep, SchedulerSide
from statetier.clients.vllm.worker import WorkerSide
from statetier.protocol.identity import Kind, prefix_hashes
from statetier.protocol.kv_events import BlockRemoved, BlockStored
from tests.support.daemons import daemon_fixture
from tests.support.waiting import wait_until

BLOCK, HEADS, HEAD, NUM_BLOCKS = 16, 2, 8, 8
ATTN = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
LAYOUT = EngineLayout((CacheGroup(0, Kind.KV, BLOCK, tuple((n, layer_id_of(n)) for n in ATTN),
                                  (StateSpec("kv", "float32", (HEADS, HEAD)),)),))


@dataclass
class FakeRequest:
    """What the connector reads of vLLM's ``Request``: ids, tokens, vLLM's block hashes."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    kv_transfer_params: dict | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, name="vllmev", config={"events": {"enabled": True, "endpoint": "ipc://ev-{tenant}"}})


def side(daemon, model: str, events: bool) -> tuple[SchedulerSide, WorkerSide]:
    extra = {"url": daemon.url, "deadline": 60.0}  # a busy machine may take seconds: no deadline misses here
    if events:
        extra["events_endpoint"] = f"ipc://{daemon.directory}/ev-default"
    cfg = ConnectorConfig.from_extra(extra)
    spec = namespace_spec(cfg, LAYOUT, model=model, revision="", config_digest="c0ffee", weight_dtype="float32",
                          tp_size=1, engine_tag="vllm-0.32/cpu")
    scheduler = SchedulerSide(cfg, LAYOUT, spec, loads=False)
    scheduler.events = connector_events(cfg, scheduler, None, LAYOUT)  # as the connector builds it
    worker = WorkerSide(cfg, LAYOUT, spec)
    worker.register({name: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for name in ATTN})
    return scheduler, worker


def prefill(scheduler: SchedulerSide, worker: WorkerSide, request: FakeRequest, block_ids) -> None:
    scheduler.after_alloc(request, block_ids, 0)
    meta = scheduler.build_meta([ScheduledStep(request, 0, len(request.prompt_token_ids), block_ids)])
    worker.save(meta.saves)


def subscribed(daemon, count: int) -> None:
    wait_until(lambda: daemon.scrape().value("statetier_event_subscribers") >= count,
               "the connector's subscription reached the daemon")


def taken_until(scheduler: SchedulerSide, count: int, timeout: float = 20.0) -> list:
    got: list = []

    def enough() -> bool:
        got.extend(scheduler.take_events())
        return len(got) >= count

    wait_until(enough, f"{count} events (so far: {got})", timeout=timeout)
    return got


def by_medium(events) -> dict[str, list]:
    out: dict[str, list] = {}
    for event in events:
        out.setdefault(event.medium, []).append(event)
    return out


def test_take_events_returns_the_daemons_events_of_the_saved_blocks_under_vllms_hashes(daemon):
    scheduler, worker = side(daemon, "tiny-llama", events=True)
    other_scheduler, other_worker = side(daemon, "another-model", events=False)
    try:
        subscribed(daemon, 1)
        prompt = list(range(100, 140))
        vllm_hashes = [b"vllm-block-0".ljust(32, b"."), b"vllm-block-1".ljust(32, b".")]
        request = FakeRequest("p-1", prompt, vllm_hashes)
        prefill(scheduler, worker, request, [[1, 2, 3]])
        prefill(other_scheduler, other_worker, FakeRequest("q-1", prompt, vllm_hashes), [[4, 5, 6]])

        stored = taken_until(scheduler, 4)  # two blocks, in host memory and (write-behind) on disk
        first = BlockStored((vllm_hashes[0],), None, tuple(prompt[:16]), BLOCK, "CPU")
        second = BlockStored((vllm_hashes[1],), vllm_hashes[0], tuple(prompt[16:32]), BLOCK, "CPU")
        assert by_medium(stored) == {
            "CPU": [first, second],
            "DISK": [BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, BLOCK, "DISK")
                     for e in (first, second)]}
        # the attention group each block was saved for (vLLM's group_idx in its events)
        assert [scheduler.events.group_of(h) for h in vllm_hashes] == [LAYOUT.attention_groups[0].index] * 2

        # a block of this namespace the connector did not save is not passed on; a delete is
        ours = prefix_hashes(prompt, BLOCK)
        with Client(daemon.url, namespace=scheduler.spec) as client:
            stranger = client.put_kv(0, b"\x07" * 32, 0, BLOCK, {"kv": torch.zeros(HEADS, BLOCK, 2 * HEAD)},
                                     request_id="someone-else")
            found = client.lookup(boundaries=[(BLOCK, ours[0])], groups=LAYOUT.layer_groups, kv_layout="blocks",
                                  lease=False)
            for ref in found.refs:
                client.delete(ref)
            client.delete(stranger)
        removed = taken_until(scheduler, 2)
        assert by_medium(removed) == {"CPU": [BlockRemoved((vllm_hashes[0],), "CPU")],
                                      "DISK": [BlockRemoved((vllm_hashes[0],), "DISK")]}
        assert scheduler.events.unmapped >= 1  # the stranger's store
        assert scheduler.take_events() == []
    finally:
        for part in (scheduler, worker, other_scheduler, other_worker):
            part.close()


def test_the_events_become_vllms_own_classes():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
    from vllm.distributed.kv_events import BlockStored as VllmStored

    source = SimpleNamespace(group_of={b"h" * 32: 1}.get)  # what ConnectorEvents.group_of answers
    stored, removed = as_vllm_events([BlockStored((b"h" * 32,), b"p" * 32, (1, 2), 2, "DISK"),
                                      BlockRemoved((b"h" * 32,), "DISK")], source, {0: "mamba", 1: "full_attention"})
    assert isinstance(stored, VllmStored) and isinstance(removed, VllmRemoved)
    assert (stored.token_ids, stored.block_size, stored.medium, removed.medium) == ([1, 2], 2, "DISK", "DISK")
    assert (stored.group_idx, stored.kv_cache_spec_kind, removed.group_idx) == (1, "full_attention", 1)
