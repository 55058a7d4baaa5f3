"""Opt-in, with vLLM (``.venv-vllm``): the connector in Mamba "align" mode inside vLLM's real
``Scheduler``, without a forward pass (as vLLM's own scheduler tests build one).

    .venv-vllm/bin/python -m tests.vllm_e2e.scheduler_align    (from the checkout's root)

The tiny GraniteMoeHybrid of ``tiny_models.py`` gives the engine config (prefix caching on,
``mamba_cache_mode="align"``, chunks of two blocks, not one: the producer rule of "none" mode is
lifted); the KV cache config is vLLM's own (``get_kv_cache_configs``) for one Mamba2 group and one
attention group. A statetier daemon (subprocess) is behind the connector (``kv_both``). A prompt of
4.5 blocks is scheduled step by step, each step answered with a sampled-token output: every
Mamba boundary state vLLM hands over (``boundary_state_offloads``: group, block id, boundary;
vLLM 0.32 offers the state at the prompt's last block end) must be in that step's save jobs,
at that block id and keyed at that boundary, and every attention block saved as the steps
complete it; the finished request's handoff must name the boundary saved, by ref (the worker
side runs in this process over real buffers, no forward pass: it saves and loads). Another
Scheduler (another engine, its prefix cache empty) then asks for the prompt: the joint hit's
state must be loaded into the block vLLM allocated for that boundary, bytes equal. And on
vLLM's own configs: ``requires_kv_delivery`` False, pipeline parallelism and the "fail" load
policy refused at start by name. Exit status 0 when it all holds, 1 otherwise.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from statetier.launch.daemons import DaemonProcess  # noqa: E402
from tests.vllm_e2e.tiny_models import VOCAB, write_granite_hybrid  # noqa: E402

PROMPT_BLOCKS = 4.5
PRODUCER_STATE_BLOCK: list[int] = []  # the block vLLM offered the state at the last block end from


def engine_config(model: Path, url: str):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
                      enable_prefix_caching=True, mamba_cache_mode="align", max_num_seqs=4, seed=0,
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="StatetierConnector", kv_connector_module_path="statetier.clients.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"url": url, "deadline": 30.0, "return_handoff": True}))
    config = args.create_engine_config()
    block = config.cache_config.block_size
    config.scheduler_config.max_num_batched_tokens = 2 * block  # chunks of two blocks
    config.scheduler_config.long_prefill_token_threshold = 0
    return config


def kv_cache_config(config):
    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    config.cache_config.kv_cache_layout = config.cache_config.kv_cache_layout or "LBHNC"  # the engine core's, on CPU
    block = config.cache_config.block_size
    attention = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32)
    mamba = MambaSpec(block_size=block, shapes=((3, 288), (8, 32, 16)), dtypes=(torch.float32, torch.float32),
                      page_size_padded=attention.page_size_bytes, mamba_cache_mode="align")
    specs = {"model.layers.0.mixer": mamba, "model.layers.2.mixer": mamba,
             "model.layers.1.self_attn.attn": attention, "model.layers.3.self_attn.attn": attention}
    (kv,) = get_kv_cache_configs(config, [specs], [64 * attention.page_size_bytes * 4])
    config.cache_config.num_gpu_blocks = kv.num_blocks  # what the engine core sets from it
    return kv


def scheduler_of(config, kv):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(config, kv, StructuredOutputManager(config), block_size=config.cache_config.block_size,
                     log_stats=True)


def new_request(config, rid: str, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    params.update_from_generation_config({}, None)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params, pooling_params=None,
                   block_hasher=get_request_block_hasher(config.cache_config.block_size, hash_fn))


def recording_offers(scheduler) -> list[dict]:
    """What vLLM hands the connector each step in ``boundary_state_offloads`` (the scheduler drops
    the block state from its output once the connector has built its metadata): recorded on the
    way in, the connector's own method called as is."""
    offered: list[dict] = []
    build = scheduler.connector.build_connector_meta

    def recorded(scheduler_output):
        state = scheduler_output.kv_connector_block_state
        offered.append(dict(state.boundary_state_offloads) if state is not None else {})
        return build(scheduler_output)

    scheduler.connector.build_connector_meta = recorded
    return offered


def worker_of(scheduler):
    """The connector's worker side in this process, over real buffers laid out as vLLM's CPU
    worker hands them over (no forward pass writes them: the test fills them)."""
    import torch

    from statetier.clients.vllm.worker import WorkerSide

    side = scheduler.connector._scheduler_side
    worker = WorkerSide(side.cfg, side.layout, side.spec, shard=0)
    blocks = scheduler.kv_cache_config.num_blocks
    page = scheduler.kv_cache_config.kv_cache_groups[1].kv_cache_spec.page_size_bytes
    buffers = {}
    for group in side.layout.groups:
        for name, _ in group.layers:
            buffers[name] = (torch.randn(blocks, 2, group.block_size, 64) if group.kind.name == "KV"
                             else torch.randint(-100, 100, (blocks, page), dtype=torch.int8))
    worker.register(buffers)
    return worker


def step(scheduler, worker) -> tuple:
    """One schedule(), the worker side's loads and saves of it (let finish), answered as a model
    runner would: a token for each request past its prompt, the connector's transfer results."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from statetier.clients.vllm import connector_classes

    out = scheduler.schedule()
    meta = out.kv_connector_metadata.step
    worker.start_loads(meta.loads)
    worker.save(meta.saves)
    worker.wait_idle(timeout=60)
    results = worker.take_results(out.finished_req_ids)
    refs = worker.take_saved_refs()
    transfer = KVConnectorOutput(finished_sending=results.sent or None, finished_recving=results.finished or None,
                                 failed_recving=results.failed,
                                 kv_connector_worker_meta=connector_classes()["StatetierWorkerMetadata"](refs))
    rids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in rids:
        request = scheduler.requests[rid]
        sampled.append([1] if request.num_computed_tokens >= request.num_prompt_tokens else [])
    runner = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                               sampled_token_ids=sampled, kv_connector_output=transfer)
    finished = scheduler.update_from_output(out, runner)
    return out, finished


def prompt_of(block: int) -> list[int]:
    import random

    rng = random.Random(7)
    return [rng.randrange(1, VOCAB) for _ in range(int(PROMPT_BLOCKS * block))]


def check_saves(scheduler, worker, block: int) -> list[str]:
    prompt = prompt_of(block)
    scheduler.add_request(new_request(scheduler.vllm_config, "p-0", prompt))
    failures, saved_states, saved_pages, params = [], [], [], None
    offers = recording_offers(scheduler)
    deadline = time.monotonic() + 120  # a hang guard: the connector's lookup is answered across steps
    while time.monotonic() < deadline:
        out, finished = step(scheduler, worker)
        if not out.num_scheduled_tokens:
            time.sleep(0.01)
        for job in out.kv_connector_metadata.step.saves:
            for item in job.items:
                if item.key.kind.name == "SSM":
                    saved_states.append((item.group, item.block_id, item.key.token_end))
                else:
                    saved_pages.append(item.key.token_end)
        for outputs in finished.values():
            for o in outputs.outputs:
                if o.finished:
                    params = o.kv_transfer_params
        if params is not None or not scheduler.requests:
            break
    offered = [(g, b, t) for step_offers in offers for entries in step_offers.values() for g, b, t in entries]
    PRODUCER_STATE_BLOCK[:] = [b for _, b, t in offered if t == (len(prompt) - 1) // block * block]
    mamba = [g for g, spec in enumerate(scheduler.kv_cache_config.kv_cache_groups)
             if type(spec.kv_cache_spec).__name__ == "MambaSpec"]
    wanted = sorted((g, b, t) for g, b, t in offered if g in mamba and b > 0 and t % block == 0 and t <= len(prompt))
    print(f"vLLM offered boundary states (group, block, tokens): {sorted(offered)}", flush=True)
    print(f"the connector saved Mamba states (group, block, tokens): {sorted(saved_states)}; "
          f"attention blocks ending at {sorted(set(saved_pages))}", flush=True)
    print(f"handoff: {None if params is None else {k: v for k, v in params['statetier'].items() if k != 'refs'}}",
          flush=True)
    if not wanted:
        failures.append("vLLM offered no boundary state in align mode")
    if sorted(saved_states) != wanted:
        failures.append(f"saved Mamba states {sorted(saved_states)} != offered {wanted}")
    if sorted(set(saved_pages)) != [block * (i + 1) for i in range(int(PROMPT_BLOCKS))]:
        failures.append(f"attention blocks saved at {sorted(set(saved_pages))}")
    if params is None or params["statetier"]["saved"] != int(PROMPT_BLOCKS) * block or not params["statetier"]["refs"]:
        failures.append(f"handoff {params and params['statetier']}")
    return failures


def check_load(scheduler, worker, producer_worker, block: int) -> list[str]:
    """Another engine (its own Scheduler and worker side) asks for the same prompt: the joint hit
    (the Mamba state at the last block end short of the last token), the state loaded into the
    block vLLM allocated for that boundary, bytes equal to the producer's boundary block."""
    prompt = prompt_of(block)
    scheduler.add_request(new_request(scheduler.vllm_config, "c-0", prompt))
    loads, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline and "c-0" in scheduler.requests:
        request = scheduler.requests["c-0"]
        block_ids = scheduler.kv_cache_manager.get_block_ids("c-0")
        out, _ = step(scheduler, worker)
        loads += [(job, scheduler.kv_cache_manager.get_block_ids("c-0")) for job in out.kv_connector_metadata.step.loads]
        if request.num_computed_tokens >= len(prompt):
            break
        if not out.num_scheduled_tokens:
            time.sleep(0.01)
    if len(loads) != 1:
        return [f"{len(loads)} load jobs for the consumer's request"]
    import torch

    (job, block_ids), failures = loads[0], []
    boundary = (len(prompt) - 1) // block * block
    states = [(item.group, item.block_id, item.ref.key.token_end) for item in job.items if item.ref.key.kind.name == "SSM"]
    mamba = next(g.index for g in worker.layout.groups if g.is_aligned)
    wanted = [(mamba, block_ids[mamba][boundary // block - 1], boundary)]
    print(f"consumer: loaded {job.tokens} tokens; Mamba state (group, block, tokens) {states}; vLLM's block table "
          f"of the Mamba group {list(block_ids[mamba])}; computed {request.num_computed_tokens}", flush=True)
    if job.tokens != boundary or states != wanted or job.problem:
        failures.append(f"the load {job.tokens} tokens, states {states} != {wanted} {job.problem}")
    name = worker.layout.group(mamba).layers[0][0]
    src = producer_worker.states(name, PRODUCER_STATE_BLOCK[0])
    dst = worker.states(name, wanted[0][1])
    counted = worker.counts.take()
    print(f"consumer's worker side: {counted}", flush=True)
    if counted.get("objects.load") != len(job.items) or any(k.startswith("refusals.") for k in counted):
        failures.append(f"the load did not land whole: {counted}")
    if not all(src[k].view(torch.uint8).equal(dst[k].view(torch.uint8)) for k in src):  # bytes: random bits hold NaNs
        failures.append(f"the loaded Mamba state differs from the producer's boundary block {PRODUCER_STATE_BLOCK}")
    return failures


def check_contract(scheduler) -> list[str]:
    """On vLLM's own configs: the connector is best effort (``requires_kv_delivery`` False),
    reports its hits' source, and refuses pipeline parallelism and the "fail" policy by name."""
    import copy

    from statetier.clients.vllm.contract import check_engine
    from statetier.protocol.errors import InvalidRequest

    failures = []
    if scheduler.connector.requires_kv_delivery is not False:
        failures.append("requires_kv_delivery is not False")
    for change, wanted in ((("parallel_config", "pipeline_parallel_size", 2), "pipeline parallelism"),
                           (("kv_transfer_config", "kv_load_failure_policy", "fail"), "kv_load_failure_policy")):
        config = copy.copy(scheduler.vllm_config)
        part, name, value = change
        setattr(config, part, copy.copy(getattr(config, part)))
        object.__setattr__(getattr(config, part), name, value)
        try:
            check_engine(config)
            failures.append(f"{name}={value!r} was not refused")
        except InvalidRequest as exc:
            print(f"refused at start: {exc}", flush=True)
            if wanted not in str(exc):
                failures.append(f"{name}={value!r} refused without naming {wanted}: {exc}")
    return failures


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="st-vllm-align-", dir="/tmp"))
    try:
        model = write_granite_hybrid(work / "hybrid")
        with DaemonProcess(name="align", metrics=False, host_capacity="256MiB") as daemon:
            config = engine_config(model, daemon.url)
            print(f"vLLM config: mamba_cache_mode={config.cache_config.mamba_cache_mode}, block size "
                  f"{config.cache_config.block_size}, prefix caching {config.cache_config.enable_prefix_caching}, "
                  f"chunks of {config.scheduler_config.max_num_batched_tokens} tokens", flush=True)
            block = config.cache_config.block_size
            producer, consumer = (scheduler_of(config, kv_cache_config(config)) for _ in range(2))
            producer_worker, consumer_worker = worker_of(producer), worker_of(consumer)
            try:
                failures = check_contract(producer)
                failures += check_saves(producer, producer_worker, block)
                failures += check_load(consumer, consumer_worker, producer_worker, block)
            finally:
                for side in (producer, consumer, producer_worker, consumer_worker):
                    (side.shutdown if hasattr(side, "shutdown") else side.close)()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for failure in failures:
        print(f"FAILED: {failure}")
    if not failures:
        print("PASSED: in align mode, inside vLLM's real Scheduler, the connector saves exactly the Mamba boundary "
              "states vLLM hands over (their blocks, their boundaries) with chunks of two blocks, and another "
              "engine loads the joint hit's state into the block vLLM allocated for that boundary, bytes equal")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
