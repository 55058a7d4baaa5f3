"""The vLLM connector's scheduler and worker logic against a real daemon, without vLLM.

Plain objects stand in for vLLM's ``Request`` and block tables; the engine's paged buffers
are real tensors laid out as vLLM 0.32 hands them to ``register_kv_caches`` on CPU
(attention: ``[blocks, kv heads, block size, 2 * head size]``; Mamba: raw int8 slots in
padded pages, conv then recurrent state). The story of each test: a producer engine
prefills and saves, a consumer engine asks, loads into *other* blocks, and gets exactly
the producer's bytes, or a typed refusal whose objects never reach its buffers. Transfers
run across steps (``test_vllm_cross_step.py`` stops the daemon under them); here each
step's lookups, loads and saves are let finish (``ask``, ``wait_idle``) before the next.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from statetier.clients import Client
from statetier.clients.values import PutItem
from statetier.clients.vllm.jobs import LoadItem, LoadJob, handoff_from_params, handoff_params
from statetier.clients.vllm.layout import (
    CacheGroup,
    ConnectorConfig,
    EngineLayout,
    layer_id_of,
    namespace_spec,
)
from statetier.clients.vllm.scheduler import ScheduledStep, SchedulerSide
from statetier.clients.vllm.worker import WorkerSide
from statetier.protocol.errors import InvalidRequest
from statetier.protocol.groups import LayerGroup
from statetier.protocol.identity import Kind, StateKey, prefix_hashes
from statetier.protocol.messages import ref_from_wire
from tests.support.daemons import daemon_fixture
from tests.support.vllm_connector import (
    ATTN,
    BLOCK,
    CONSUMER_BLOCKS,
    MAMBA,
    PRODUCER_BLOCKS,
    Engine,
    FakeRequest,
    ask,
    attention_layout,
    engine_buffers,
    hybrid_layout,
    load,
    make_engine,
    prefill,
    restore,
    tokens,
)
from tests.support.waiting import wait_until



@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, metrics=False, name="vllmconn")


def prefilled_pair(engines, seed: int, length: int = 40) -> tuple[Engine, Engine, list[int]]:
    """A producer that has prefilled ``tokens(seed, length)`` as request ``p-<seed>`` into
    ``PRODUCER_BLOCKS``, a consumer that has seen nothing, and the prompt."""
    producer, consumer = engines(role="producer", seed=seed), engines(role="consumer", seed=None)
    prompt = tokens(seed, length)
    prefill(producer, FakeRequest(f"p-{seed}", prompt), PRODUCER_BLOCKS, seed=seed)
    return producer, consumer, prompt


def test_a_producer_saves_every_prompt_block_and_the_mamba_state_at_step_ends_on_block_ends(engines) -> None:
    producer = engines(role="producer", seed=1)
    request = FakeRequest("p-1", tokens(1, 40))
    metas = prefill(producer, request, PRODUCER_BLOCKS)
    hashes = prefix_hashes(request.prompt_token_ids, BLOCK)
    planned = [[(i.group, i.key.kind, i.key.layer, i.key.group_layers, i.key.token_start, i.key.token_end,
                 i.key.prefix_hash, i.block_id) for job in m.saves for i in job.items] for m in metas]
    assert planned == [  # one object per block of the attention group, one per boundary of the Mamba group
        [(1, Kind.KV, 1, (1, 3), 0, 16, hashes[0], 1), (0, Kind.SSM, 0, (0, 2), 0, 16, hashes[0], 9)],
        [(1, Kind.KV, 1, (1, 3), 16, 32, hashes[1], 2), (0, Kind.SSM, 0, (0, 2), 0, 32, hashes[1], 9)],
        [],  # 32 -> 40: no block completes, and a state at 40 is at no block end
    ]
    assert [job.step for m in metas for job in m.saves] == [16, 32]
    delay_free, params = producer.scheduler.request_finished(request)
    assert delay_free  # saves were scheduled: vLLM keeps the blocks until the workers report them sent
    handoff = handoff_from_params(params)
    assert handoff.tokens == 32 and handoff.block_size == BLOCK
    assert sorted((r.key.kind, r.key.layer, r.key.group_layers, r.key.token_start, r.key.token_end)
                  for r in handoff.refs) == [
        (Kind.KV, 1, (1, 3), 0, 16), (Kind.KV, 1, (1, 3), 16, 32), (Kind.SSM, 0, (0, 2), 0, 32)]


def test_a_consumer_restores_the_joint_hit_into_its_own_blocks_and_slot(engines) -> None:
    producer, consumer, prompt = prefilled_pair(engines, 2)
    request = FakeRequest("c-2", prompt)
    assert ask(consumer.scheduler, request) == 32
    assert consumer.scheduler.matched_tokens(request, 0) == 32  # asked again: the same answer
    assert restore(consumer, request, CONSUMER_BLOCKS) == 32
    for name in ATTN:
        for src, dst in ((1, 5), (2, 7)):
            assert torch.equal(consumer.buffers[name][dst], producer.buffers[name][src])
        assert not consumer.buffers[name][11].any()  # the partial third block is computed, not loaded
    for name in MAMBA:
        loaded = consumer.worker.states(name, 2)
        at_32, at_16 = producer.snapshots[("p-2", 32, name)], producer.snapshots[("p-2", 16, name)]
        assert all(torch.equal(loaded[k], at_32[k]) for k in at_32)  # the state at 32, not the one at 16
        assert not torch.equal(loaded["recurrent"], at_16["recurrent"])
    assert consumer.worker.take_failed_blocks() == set()
    assert consumer.scheduler.matched_tokens(request, 0) == 0  # one load per request


def test_a_handoff_loads_by_ref_and_never_offers_the_whole_prompt(engines) -> None:
    producer, consumer, prompt = prefilled_pair(engines, 3, length=32)
    _, params = producer.scheduler.request_finished(FakeRequest("p-3", prompt))
    # vLLM computes at least one token: of a 32-token prompt, the handoff offers 16 (a state at 16 exists)
    assert handoff_from_params(params).tokens == 16
    request = FakeRequest("c-3", prompt, kv_transfer_params=params)
    assert restore(consumer, request, CONSUMER_BLOCKS) == 16
    for name in ATTN:
        assert torch.equal(consumer.buffers[name][5], producer.buffers[name][1])
        assert not consumer.buffers[name][7].any()
    for name in MAMBA:
        want = producer.snapshots[("p-3", 16, name)]
        assert all(torch.equal(consumer.worker.states(name, 2)[k], want[k]) for k in want)


def swap_ssm(params: dict, replacement: dict[int, dict]) -> dict:
    out = copy.deepcopy(params)
    refs = out["statetier"]["refs"]
    for i, ref in enumerate(refs):
        if ref["key"]["kind"] == "ssm":
            refs[i] = replacement[ref["key"]["layer"]]
    return out


@pytest.mark.parametrize("fault", ["another_requests_state", "one_step_stale_state", "another_requests_handoff"])
def test_a_mixed_up_handoff_is_refused_writes_nothing_and_is_never_offered_again(engines, fault) -> None:
    producer, consumer = engines(role="producer", seed=4), engines(role="consumer", seed=None)
    prompt_a, prompt_b = tokens(41, 40), tokens(42, 40)
    saves_a = prefill(producer, FakeRequest("p-a", prompt_a), PRODUCER_BLOCKS, seed=41)
    prefill(producer, FakeRequest("p-b", prompt_b), ([10], [4, 6, 8]), seed=42)
    _, params_a = producer.scheduler.request_finished(FakeRequest("p-a", prompt_a))
    _, params_b = producer.scheduler.request_finished(FakeRequest("p-b", prompt_b))
    if fault == "another_requests_state":  # B's Mamba states handed over with A's pages
        b_ssm = {r["key"]["layer"]: r for r in params_b["statetier"]["refs"] if r["key"]["kind"] == "ssm"}
        params = swap_ssm(params_a, b_ssm)
    elif fault == "one_step_stale_state":  # "the state at 32" names the object the slot held at 16
        refs_16 = _saved_refs(producer, saves_a, "p-a", 16)
        params = copy.deepcopy(params_a)
        for i, ref in enumerate(params["statetier"]["refs"]):
            if ref["key"]["kind"] == "ssm":
                older = refs_16[ref["key"]["layer"]]
                params["statetier"]["refs"][i] = {**ref, "state_id": older.state_id.hex(), "version": older.version,
                                                  "request_id": older.request_id, "step": older.step}
    else:
        params = params_b
    request = FakeRequest("c-a", prompt_a, kv_transfer_params=params)
    assert consumer.scheduler.matched_tokens(request, 0) == 32
    consumer.scheduler.after_alloc(request, CONSUMER_BLOCKS, 32)
    load(consumer, consumer.scheduler.build_meta([]).loads)
    results = consumer.worker.take_results()
    assert results.finished == {"c-a"} and results.failed == {"c-a"}
    assert consumer.worker.take_failed_blocks() == {5, 7}  # vLLM recomputes every block of the request
    assert not any(v.any() for name in MAMBA for v in consumer.worker.states(name, 2).values())  # never reached
    if fault == "another_requests_handoff":  # every object refused: nothing written at all
        assert all(not t.any() for t in consumer.buffers.values())
    assert consumer.scheduler.matched_tokens(request, 0) == 0  # no second attempt


def _saved_refs(producer: Engine, metas, request_id: str, absorbed: int) -> dict:
    """The refs of the producer's Mamba snapshots at ``absorbed``, asked of the daemon by key."""
    out = {}
    with Client(producer.scheduler.cfg.url, namespace=producer.scheduler.spec, use_shm=False) as client:
        for meta in metas:
            for job in meta.saves:
                for item in job.items:
                    if item.key.kind is Kind.SSM and item.key.token_end == absorbed:
                        found = client.lookup(boundaries=[(absorbed, item.key.prefix_hash)],
                                              groups=[LayerGroup.of_key(item.key)], lease=False)
                        (ref,) = found.refs
                        assert ref.request_id == request_id
                        out[item.key.layer] = ref
    return out


def test_a_consumer_of_another_namespace_finds_nothing(engines, daemon) -> None:
    producer = engines(role="producer", seed=5)
    prompt = tokens(5, 40)
    prefill(producer, FakeRequest("p-5", prompt), PRODUCER_BLOCKS, seed=5)
    other = make_engine(daemon, hybrid_layout(), role="consumer", seed=None, tp_size=2)  # another TP size
    try:
        assert ask(other.scheduler, FakeRequest("c-5", prompt)) == 0
    finally:
        other.close()


def test_the_joint_hit_is_the_boundary_every_tp_shard_holds(engines) -> None:
    layout = attention_layout()
    rank0 = engines(layout, role="producer", seed=6, tp_size=2, shard=0)
    rank1 = engines(layout, role="producer", seed=7, tp_size=2, shard=1)
    prompt = tokens(6, 50)
    blocks = ([1, 2, 3, 4],)
    rank0.scheduler.after_alloc(FakeRequest("p-6", prompt), blocks, 0)
    meta = rank0.scheduler.build_meta([ScheduledStep(FakeRequest("p-6", prompt), 0, 48, blocks)])
    rank0.worker.save(meta.saves)                          # rank 0: blocks 0, 1, 2
    rank1.worker.save([_first_block_only(meta.saves[0])])  # rank 1: block 0 only
    rank0.worker.wait_idle()
    rank1.worker.wait_idle()
    consumer = engines(layout, role="consumer", seed=None, tp_size=2, shard=1)
    request = FakeRequest("c-6", prompt)
    assert ask(consumer.scheduler, request) == 16
    consumer.scheduler.after_alloc(request, ([6, 7, 8, 9],), 16)
    (job,) = consumer.scheduler.build_meta([]).loads
    assert sorted((i.ref.key.shard, i.ref.key.layer, i.ref.key.token_end, i.block_id) for i in job.items) == [
        (0, 0, 16, 6), (1, 0, 16, 6)]  # group 0's object of block 0, on each shard
    load(consumer, [job])  # this worker is rank 1: it loads its own shard's pages only
    assert consumer.worker.take_results().failed == set()
    for name in ATTN:
        assert torch.equal(consumer.buffers[name][6], rank1.buffers[name][1])


def _first_block_only(job):
    from statetier.clients.vllm.jobs import SaveJob

    return SaveJob(job.request_id, job.step, tuple(i for i in job.items if i.key.token_end == BLOCK))


# -- a Mamba state every TP rank holds the same (vLLM's MambaSpec.tp_replicated; issue 32) ------
# A TP=2 producer (one scheduler, two ranks' workers and buffers) prefills a hybrid prompt. With
# the Mamba group replicated, rank 0 alone saves its state, as shard 0: one object per boundary in
# the daemon, none of shard 1; the attention group is still saved by each rank under its own
# shard. A TP=2 consumer finds the joint hit by lookup and by the producer's handoff, and both of
# its ranks load that one Mamba object, each its own shard of the pages. A group not replicated
# is saved by each rank.


def tp2_layout(replicated: bool) -> EngineLayout:
    """The test hybrid, its Mamba group replicated across TP ranks or sharded."""
    return EngineLayout(tuple(dataclasses.replace(g, is_replicated=replicated) if g.kind is Kind.SSM else g
                              for g in hybrid_layout().groups))


def tp2_pair(engines, role: str, layout: EngineLayout, seed: int | None) -> tuple[Engine, Engine]:
    """Rank 0 and rank 1 of one TP=2 engine (rank 0's scheduler is the engine's); a producer's
    attention pages differ by rank (seeds ``seed`` and ``seed + 1``)."""
    rank0 = engines(layout, role=role, seed=seed, tp_size=2, shard=0)
    return rank0, engines(layout, role=role, seed=None if seed is None else seed + 1, tp_size=2, shard=1)


def ssm_hit(client: Client, layout: EngineLayout, prompt: list[int], **shards) -> int:
    """The daemon's joint hit over the Mamba group alone at 32 tokens, TP=2 (``group_shards`` given or not)."""
    hashes = prefix_hashes(prompt, BLOCK)
    (mamba,) = layout.mamba_groups
    found = client.lookup(boundaries=[(32, hashes[1])], groups=[mamba.layer_group], tp_size=2, lease=False, **shards)
    return found.tokens


@pytest.mark.parametrize("replicated", [True, False], ids=["replicated", "per_rank"])
def test_a_replicated_mamba_state_is_saved_once_and_every_rank_restores_it(engines, replicated) -> None:
    layout, seed = tp2_layout(replicated), 60 if replicated else 70
    rank0, rank1 = tp2_pair(engines, "producer", layout, seed)
    prompt = tokens(seed, 40)
    produced = FakeRequest(f"p-{seed}", prompt)
    prefill(rank0, produced, PRODUCER_BLOCKS, seed=seed, ranks=(rank1,))

    # two attention blocks on each rank; the Mamba states at 16 and 32 once (rank 0) or on each rank
    assert rank0.worker.counts.get("objects.save") == 4
    assert rank1.worker.counts.get("objects.save") == (2 if replicated else 4)
    _, params = rank0.scheduler.request_finished(produced)
    handed = params["statetier"]["refs"]
    assert sorted((r["key"]["kind"], r["key"]["shard"]) for r in handed) == sorted(
        [("kv", 0), ("kv", 0), ("kv", 1), ("kv", 1), ("ssm", 0)] + ([] if replicated else [("ssm", 1)]))
    with Client(rank0.scheduler.cfg.url, namespace=rank0.scheduler.spec, use_shm=False) as client:
        assert ssm_hit(client, layout, prompt, group_shards=[1]) == 32  # shard 0's object
        assert ssm_hit(client, layout, prompt) == (0 if replicated else 32)  # shard 1's: none when replicated

    consumer0, consumer1 = tp2_pair(engines, "consumer", layout, None)
    for how, params_given, blocks in (("lookup", None, CONSUMER_BLOCKS), ("handoff", params, ([3], [4, 6, 8]))):
        request = FakeRequest(f"c-{seed}-{how}", prompt, kv_transfer_params=params_given)
        assert ask(consumer0.scheduler, request) == 32, how  # the joint hit holds on both ranks
        consumer0.scheduler.after_alloc(request, blocks, 32)
        (job,) = consumer0.scheduler.build_meta([]).loads
        assert sorted((i.ref.key.kind.name, i.ref.key.shard) for i in job.items) == sorted(
            [("KV", 0), ("KV", 0), ("KV", 1), ("KV", 1), ("SSM", 0)] + ([] if replicated else [("SSM", 1)])), how
        for consumer, producer in ((consumer0, rank0), (consumer1, rank1)):
            load(consumer, [job])
            assert consumer.worker.take_results().failed == set(), how
            for name in ATTN:  # each rank its own shard of the pages
                for src, dst in zip(PRODUCER_BLOCKS[1][:2], blocks[1][:2]):
                    assert torch.equal(consumer.buffers[name][dst], producer.buffers[name][src]), (how, name)
            for name in MAMBA:  # every rank the state at 32 (replicated: rank 0's one object)
                want = rank0.snapshots[(produced.request_id, 32, name)]
                got = consumer.worker.states(name, blocks[0][0])
                assert all(torch.equal(got[k], want[k]) for k in want), (how, name)
        # each rank: its 2 pages and one Mamba object (replicated: the same one on both ranks)
        assert [c.worker.counts.get("objects.load") for c in (consumer0, consumer1)] == [3, 3], how
        for consumer in (consumer0, consumer1):
            consumer.worker.counts.take()
        consumer0.scheduler.loads_finished([request.request_id])


def test_a_local_prefix_cache_hit_is_not_overwritten(engines) -> None:
    layout = attention_layout()
    producer, consumer = engines(layout, role="producer", seed=8), engines(layout, role="consumer", seed=None)
    prompt = tokens(8, 50)
    blocks = ([1, 2, 3, 4],)
    producer.scheduler.after_alloc(FakeRequest("p-8", prompt), blocks, 0)
    step = ScheduledStep(FakeRequest("p-8", prompt), 0, 50, blocks)
    producer.worker.save(producer.scheduler.build_meta([step]).saves)
    producer.worker.wait_idle()
    request = FakeRequest("c-8", prompt)
    assert ask(consumer.scheduler, request, 16) == 32  # 48 restorable, 16 already local
    consumer.scheduler.after_alloc(request, ([6, 7, 8, 9],), 32)
    (job,) = consumer.scheduler.build_meta([]).loads
    assert sorted({i.block_id for i in job.items}) == [7, 8] and job.attention_blocks == (7, 8)


def test_step_metadata_survives_pickling(engines) -> None:
    producer = engines(role="producer", seed=9)
    request = FakeRequest("p-9", tokens(9, 20))
    producer.scheduler.after_alloc(request, PRODUCER_BLOCKS, 0)
    meta = producer.scheduler.build_meta([ScheduledStep(request, 0, 16, PRODUCER_BLOCKS)])
    assert meta.saves and pickle.loads(pickle.dumps(meta)) == meta


def test_settings_are_checked_and_layer_ids_read_from_names() -> None:
    with pytest.raises(InvalidRequest, match="url"):
        ConnectorConfig.from_extra({})
    with pytest.raises(InvalidRequest, match="unknown keys"):
        ConnectorConfig.from_extra({"url": "unix:///x", "tennant": "a"})
    assert ConnectorConfig.from_extra({"url": "unix:///x", "publish": True}).publish is True
    assert layer_id_of("model.layers.12.self_attn.attn") == 12
    with pytest.raises(InvalidRequest):
        layer_id_of("model.embed")
    with pytest.raises(InvalidRequest, match="same block size"):
        EngineLayout((CacheGroup(0, Kind.KV, 16, (("a.0", 0),)), CacheGroup(1, Kind.KV, 32, (("a.1", 1),))))
    with pytest.raises(InvalidRequest, match="attention"):
        EngineLayout((CacheGroup(0, Kind.SSM, 16, (("m.0", 0),)),))


def test_the_namespace_names_everything_that_makes_state_incompatible() -> None:
    cfg = ConnectorConfig.from_extra({"url": "unix:///x"})
    base = dict(model="m", revision="", config_digest="c", weight_dtype="float32", tp_size=1,
                engine_tag="vllm-0.32/cpu")
    ns = namespace_spec(cfg, hybrid_layout(), **base).namespace()
    variants = [
        namespace_spec(cfg, hybrid_layout(), **{**base, "tp_size": 2}),
        namespace_spec(cfg, hybrid_layout(), **{**base, "config_digest": "d"}),
        namespace_spec(cfg, hybrid_layout(), **{**base, "engine_tag": "vllm-0.32/cuda"}),
        namespace_spec(cfg, attention_layout(), **base),
        namespace_spec(ConnectorConfig.from_extra({"url": "unix:///x", "model_fingerprint": "w1"}), hybrid_layout(),
                       **base),
        namespace_spec(ConnectorConfig.from_extra({"url": "unix:///x", "tenant": "t2"}), hybrid_layout(), **base),
    ]
    assert all(v.namespace() != ns for v in variants)
    assert len({v.namespace() for v in variants}) == len(variants)


def test_a_handoff_parses_or_is_refused_loudly() -> None:
    assert handoff_from_params(None) is None and handoff_from_params({"other": 1}) is None
    with pytest.raises(InvalidRequest):
        handoff_from_params({"statetier": {"tokens": 16}})
    with pytest.raises(InvalidRequest):
        handoff_from_params({"statetier": {"tokens": 0, "block_size": 16, "refs": []}})


def test_a_hit_that_vllm_trims_is_refused_rather_than_loaded_at_the_wrong_position(engines) -> None:
    producer, consumer, prompt = prefilled_pair(engines, 10)
    request = FakeRequest("c-10", prompt)
    assert ask(consumer.scheduler, request) == 32
    consumer.scheduler.after_alloc(request, CONSUMER_BLOCKS, 16)  # vLLM took only 16 of the 32
    load(consumer, consumer.scheduler.build_meta([]).loads)
    assert consumer.worker.take_results().failed == {"c-10"}
    assert consumer.worker.take_failed_blocks() == {5}  # the block vLLM believed loaded
    assert all(not t.any() for t in consumer.buffers.values())


def test_the_lookup_leases_are_held_until_vllm_reports_the_load_done(engines, daemon) -> None:
    producer, consumer, prompt = prefilled_pair(engines, 11)
    with Client(daemon.url, use_shm=False) as observer:
        wait_until(lambda: observer.stats()["leases"] == 0, "every lease released")
        request = FakeRequest("c-11", prompt)
        assert ask(consumer.scheduler, request) == 32
        assert observer.stats()["leases"] == 3  # 2 blocks of the attention group + the Mamba group, pinned
        consumer.scheduler.after_alloc(request, CONSUMER_BLOCKS, 32)
        load(consumer, consumer.scheduler.build_meta([]).loads)
        assert observer.stats()["leases"] >= 3  # still pinned while vLLM has not heard back
        consumer.scheduler.loads_finished(consumer.worker.take_results().finished)
        wait_until(lambda: observer.stats()["leases"] == 0, "every lease released")


def test_a_handoff_missing_a_group_is_no_hit(engines) -> None:
    producer, consumer, prompt = prefilled_pair(engines, 12)
    _, params = producer.scheduler.request_finished(FakeRequest("p-12", prompt))
    params["statetier"]["refs"] = [r for r in params["statetier"]["refs"] if r["key"]["kind"] != "ssm"]
    assert consumer.scheduler.matched_tokens(FakeRequest("c-12", prompt, kv_transfer_params=params), 0) == 0


def test_an_unreachable_daemon_is_a_miss_and_a_failed_load_never_an_engine_error(tmp_path) -> None:
    cfg = ConnectorConfig.from_extra({"url": f"unix://{tmp_path}/nobody.sock", "timeout": 2.0, "deadline": 60.0})
    layout = hybrid_layout()
    spec = namespace_spec(cfg, layout, model="m", revision="", config_digest="c", weight_dtype="float32", tp_size=1,
                          engine_tag="vllm-0.32/cpu")
    scheduler = SchedulerSide(cfg, layout, spec)
    worker = WorkerSide(cfg, layout, spec)
    worker.register(engine_buffers(layout, seed=None))
    request = FakeRequest("r", tokens(13, 40))
    assert ask(scheduler, request) == 0
    assert scheduler.counts.take() == {"lookups": 1, "misses.unavailable": 1}
    scheduler.after_alloc(request, CONSUMER_BLOCKS, 0)
    worker.save(scheduler.build_meta([ScheduledStep(request, 0, 16, CONSUMER_BLOCKS)]).saves)  # logged, not raised
    worker.wait_idle()
    ref = ref_from_wire({"key": {"ns": spec.namespace().hex(), "kind": "kv", "layer": 1, "shard": 0,
                                 "prefix": prefix_hashes(request.prompt_token_ids, BLOCK)[0].hex(), "start": 0,
                                 "end": 16}, "request_id": "x", "step": 16, "state_id": "00" * 16, "version": 1,
                         "fingerprint": "00" * 32})
    worker.start_loads([LoadJob("r", 16, (LoadItem(1, ref, 5),), (5,))])
    worker.wait_idle()
    results = worker.take_results({"r"})
    assert results.failed == {"r"} and worker.take_failed_blocks() == {5}
    assert results.sent == {"r"}  # its save failed, yet it is reported: vLLM frees the blocks
    scheduler.close()
    worker.close()


def per_layer_saves(daemon, producer: Engine, request_id: str, prompt: list[int], block_ids) -> dict:
    """What a producer saved before group objects: one object per layer per block, and one
    per Mamba layer at 32 tokens, sealed from its buffers; the refs, as a handoff names them."""
    hashes = prefix_hashes(prompt, BLOCK)
    items = []
    for name, lid in zip(ATTN, (1, 3)):
        for block in (0, 1):
            key = StateKey(producer.scheduler.namespace, Kind.KV, lid, hashes[block], block * BLOCK, (block + 1) * BLOCK)
            items.append(PutItem(key, {"kv": producer.buffers[name][block_ids[1][block]]}, request_id=request_id,
                                 step=(block + 1) * BLOCK))
    for name, lid in zip(MAMBA, (0, 2)):
        key = StateKey(producer.scheduler.namespace, Kind.SSM, lid, hashes[1], 0, 2 * BLOCK)
        items.append(PutItem(key, producer.worker.states(name, block_ids[0][0]), request_id=request_id, step=32))
    with Client(daemon.url, namespace=producer.scheduler.spec) as client:
        refs = client.put_many(items)
    return handoff_params(32, BLOCK, refs)


@pytest.mark.parametrize("by", ["lookup", "handoff"])
def test_per_layer_objects_saved_before_group_objects_stay_readable(engines, daemon, by) -> None:
    producer, consumer = engines(role="producer", seed=14), engines(role="consumer", seed=None)
    for name in MAMBA:
        for view in producer.worker.states(name, PRODUCER_BLOCKS[0][0]).values():
            view.copy_(torch.randn(view.shape))
    prompt = tokens(14 if by == "lookup" else 15, 40)
    params = per_layer_saves(daemon, producer, f"old-{by}", prompt, PRODUCER_BLOCKS)
    request = FakeRequest(f"c-{by}", prompt, kv_transfer_params=params if by == "handoff" else None)
    assert restore(consumer, request, CONSUMER_BLOCKS) == 32
    assert consumer.worker.counts.take()["objects.load"] == 6  # 2 layers x 2 blocks + 2 Mamba layers
    for name in ATTN:
        for src, dst in ((1, 5), (2, 7)):
            assert torch.equal(consumer.buffers[name][dst], producer.buffers[name][src])
    for name in MAMBA:
        want = producer.worker.states(name, PRODUCER_BLOCKS[0][0])
        assert all(torch.equal(consumer.worker.states(name, CONSUMER_BLOCKS[0][0])[k], want[k]) for k in want)
