"""The vLLM connector's test engines without vLLM: layouts, paged buffers laid out as vLLM
0.32 hands them to ``register_kv_caches`` on CPU, a producer/consumer ``Engine`` (scheduler,
worker, buffers) over a real daemon, and the steps a test drives (``prefill``, ``ask``,
``load``, ``restore``). Used by tests/clients/test_vllm_*.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from statetier.clients.vllm.contract import returns_handoff
from statetier.clients.vllm.jobs import StepMeta
from statetier.clients.vllm.layout import CacheGroup, ConnectorConfig, EngineLayout, StateSpec, layer_id_of, namespace_spec
from statetier.clients.vllm.scheduler import ScheduledStep, SchedulerSide
from statetier.clients.vllm.worker import WorkerSide
from statetier.protocol.identity import Kind

BLOCK, HEADS, HEAD = 16, 2, 8
CONV, RECURRENT = (3, 24), (4, 8, 4)
STATE_BYTES = (3 * 24 + 4 * 8 * 4) * 4
PAGE_BYTES = 1024  # vLLM pads Mamba pages to the attention page size
NUM_BLOCKS = 12
ATTN = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
MAMBA = ("model.layers.0.mixer", "model.layers.2.mixer")


def hybrid_layout() -> EngineLayout:
    mamba = CacheGroup(0, Kind.SSM, 1024, tuple((n, layer_id_of(n)) for n in MAMBA),
                       (StateSpec("conv", "float32", CONV), StateSpec("recurrent", "float32", RECURRENT)))
    attention = CacheGroup(1, Kind.KV, BLOCK, tuple((n, layer_id_of(n)) for n in ATTN),
                           (StateSpec("kv", "float32", (HEADS, HEAD)),))
    return EngineLayout((mamba, attention))  # block_ids[0] is the Mamba group, as in vLLM


def attention_layout() -> EngineLayout:
    return EngineLayout((CacheGroup(0, Kind.KV, BLOCK, tuple((n, layer_id_of(n)) for n in ATTN),
                                    (StateSpec("kv", "float32", (HEADS, HEAD)),)),))


def engine_buffers(layout: EngineLayout, seed: int | None) -> dict[str, torch.Tensor]:
    """Paged buffers: random (a producer that computed) or zeros (a fresh consumer)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for group in layout.groups:
        for name, _ in group.layers:
            if group.kind is Kind.KV:
                shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
                out[name] = torch.randn(shape, generator=gen) if gen else torch.zeros(shape)
            else:
                pages = torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.int8)
                out[name] = pages[:, :STATE_BYTES].view(NUM_BLOCKS, 1, 1, STATE_BYTES)
    return out


@dataclass
class FakeRequest:
    """What the connector reads of vLLM's ``Request`` (``vllm/v1/request.py``)."""

    request_id: str
    prompt_token_ids: list[int] | None
    kv_transfer_params: dict | None = None
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: object | None = None     # vLLM's LoRARequest: lora_name, lora_int_id, lora_path
    mm_features: list | None = None        # vLLM's MultiModalFeatureSpec: identifier, mm_position
    prompt_embeds: torch.Tensor | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else len(self.prompt_embeds)


def tokens(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 30000, (n,), generator=gen).tolist()


@dataclass
class Engine:
    """One side of a connector pair, as vLLM would hold it: scheduler, worker, buffers."""

    layout: EngineLayout
    scheduler: SchedulerSide
    worker: WorkerSide
    buffers: dict[str, torch.Tensor]
    snapshots: dict = field(default_factory=dict)  # (request, tokens, layer) -> states written

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


def make_engine(daemon, layout, *, role: str, seed: int | None, tp_size: int = 1, shard: int = 0,
                tenant: str = "default", deadline: float = 60.0, model: str = "tiny-hybrid",
                drops_last_block: bool = False, extra: dict | None = None) -> Engine:
    """``role``: ``producer``, ``consumer`` or ``both`` (vLLM's ``kv_<role>``); ``extra``: more
    ``kv_connector_extra_config``. The sides are built as the connector's start builds them."""
    cfg = ConnectorConfig.from_extra({"url": daemon.url, "tenant": tenant, "deadline": deadline, **(extra or {})})
    spec = namespace_spec(cfg, layout, model=model, revision="", config_digest="c0ffee",
                          weight_dtype="float32", tp_size=tp_size, engine_tag="vllm-0.32/cpu")
    scheduler = SchedulerSide(cfg, layout, spec, tp_size=tp_size, loads=role != "producer",
                              saves=role != "consumer", drops_last_block=drops_last_block,
                              hands_off=returns_handoff(cfg, f"kv_{role}"))
    worker = WorkerSide(cfg, layout, spec, shard=shard)
    buffers = engine_buffers(layout, seed)
    worker.register(buffers)
    return Engine(layout, scheduler, worker, buffers)


def prefill(engine: Engine, request: FakeRequest, block_ids, chunk: int = BLOCK, seed: int = 0,
            ranks: tuple[Engine, ...] = ()) -> list[StepMeta]:
    """Run the request's prompt through the scheduler in chunks; before each step's saves,
    the Mamba slot gets new random states (what the model would have computed).

    ``ranks``: the engine's other TP ranks (their own workers and buffers): every rank's worker
    saves each step that ``engine``'s scheduler plans, its Mamba slot given the same states
    (as a replicated state is), and the scheduler hears of every rank's refs."""
    engine.scheduler.after_alloc(request, block_ids, 0)
    metas, done = [], 0
    while done < request.prompt_length:
        n = min(chunk, request.prompt_length - done)
        meta = engine.scheduler.build_meta([ScheduledStep(request, done, n, block_ids)])
        done += n
        for rank in (engine, *ranks):
            for group in rank.layout.mamba_groups:
                for name, lid in group.layers:
                    gen = torch.Generator().manual_seed(seed * 1000 + done * 10 + lid)
                    for view in rank.worker.states(name, block_ids[group.index][0]).values():
                        view.copy_(torch.randn(view.shape, generator=gen))
                    rank.snapshots[(request.request_id, done, name)] = {
                        k: v.clone() for k, v in rank.worker.states(name, block_ids[group.index][0]).items()}
            rank.worker.save(meta.saves)
        metas.append(meta)
    for rank in (engine, *ranks):
        rank.worker.wait_idle()
        engine.scheduler.refs_saved(rank.worker.take_saved_refs())
    return metas


def report_saved(engine: Engine) -> None:
    """What vLLM's worker -> scheduler metadata carries each step: the refs saves were answered with."""
    engine.scheduler.refs_saved(engine.worker.take_saved_refs())


def ask(scheduler: SchedulerSide, request: FakeRequest, num_computed: int = 0) -> int:
    """``matched_tokens`` asked step after step, as vLLM does, until it answers."""
    deadline = time.monotonic() + 120  # a hang guard, not a measurement
    while (tokens := scheduler.matched_tokens(request, num_computed)) is None:
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.005)
    return tokens


def load(engine: Engine, loads) -> None:
    """One step's loads started, and let finish."""
    engine.worker.start_loads(loads)
    engine.worker.wait_idle()


def restore(engine: Engine, request: FakeRequest, block_ids) -> int:
    """Admission as vLLM does it: matched tokens, allocation, one step's loads."""
    matched = ask(engine.scheduler, request)
    engine.scheduler.after_alloc(request, block_ids, matched)
    load(engine, engine.scheduler.build_meta([]).loads)
    engine.scheduler.loads_finished(engine.worker.take_results().finished)
    return matched


PRODUCER_BLOCKS = ([9], [1, 2, 3])
CONSUMER_BLOCKS = ([2], [5, 7, 11])
