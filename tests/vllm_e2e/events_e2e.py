"""Opt-in, with vLLM (``.venv-vllm``): vLLM's own KV event stream carries the connector's events
for a saved prompt (issue 26).

    .venv-vllm/bin/python -m tests.vllm_e2e.events_e2e    (from the checkout's root)

A statetier daemon (subprocess, ``[events]`` on) and, in this process, one vLLM engine (CPU)
serving the tiny Llama of ``tiny_models.py`` with the statetier connector as producer
(``events_endpoint``: the daemon's stream) and vLLM's KV events on (ZMQ, prefix caching on, so
vLLM announces its own GPU blocks too). A SUB socket on vLLM's stream, decoded with the Structs
written from vLLM's schema (``tests/support/kv_event_schema.py``), must see, for the prompt's
two full blocks of 128 tokens: vLLM's ``GPU`` ``BlockStored`` and the connector's ``CPU`` (host
arena) and ``DISK`` (write-behind) ones, under the same block hashes, parents and tokens.
Exit status 0 when it does, 1 otherwise.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # before vLLM is imported (in main)

from statetier.launch.daemons import DaemonProcess  # noqa: E402
from tests.support.kv_event_schema import BlockStored, Subscriber  # noqa: E402
from tests.vllm_e2e.tiny_models import VOCAB, write_llama  # noqa: E402

BLOCK = 128
PROMPT_TOKENS = 2 * BLOCK + 32
WAIT_SECONDS = 120


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="st-vllm-ev-", dir="/tmp"))
    try:
        model = write_llama(work / "llama")
        config = {"events": {"enabled": True, "endpoint": "ipc://ev-{tenant}"}}
        with DaemonProcess(config, name="vllmev", metrics=False, host_capacity="256MiB") as daemon:
            vllm_stream = f"ipc://{work}/vllm-events"
            subscriber = Subscriber(vllm_stream)
            try:
                found = run_engine(model, daemon, vllm_stream, subscriber)
            finally:
                subscriber.close()
        return report(found)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_engine(model: Path, daemon: DaemonProcess, vllm_stream: str, subscriber: Subscriber) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra = {"url": daemon.url, "model_fingerprint": "tiny-llama-seed-13", "deadline": 5.0,
             "events_endpoint": f"ipc://{daemon.directory}/ev-default"}
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024, block_size=BLOCK,
              max_num_batched_tokens=BLOCK, enable_chunked_prefill=True, enable_prefix_caching=True, max_num_seqs=4,
              seed=0,
              kv_transfer_config=KVTransferConfig(kv_connector="StatetierConnector",
                                                  kv_connector_module_path="statetier.clients.vllm",
                                                  kv_role="kv_producer", kv_load_failure_policy="recompute",
                                                  kv_connector_extra_config=extra),
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=vllm_stream))
    rng = random.Random(26)
    prompt = [rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    found: dict = {"prompt": prompt, "stored": []}
    deadline = time.monotonic() + WAIT_SECONDS
    other = [rng.randrange(1, VOCAB) for _ in range(8)]
    while time.monotonic() < deadline and not _complete(found):
        # the connector's events reach vLLM's stream when the scheduler steps: keep it stepping
        llm.generate([TokensPrompt(prompt_token_ids=other)], SamplingParams(max_tokens=4, temperature=0.0,
                                                                            ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        for _, _, batch in subscriber.drain(quiet=0.2):
            found["stored"] += [e for e in batch.events if isinstance(e, BlockStored)]
    return found


def _blocks(found: dict, medium: str) -> dict[int, tuple]:
    """The prompt's full blocks (0, 1) a ``medium``'s events stored: block → (hash, parent).
    One vLLM event may store several blocks (their hashes in order, their tokens one after another)."""
    prompt = found["prompt"]
    out = {}
    for event in found["stored"]:
        if event.medium != medium:
            continue
        for i, block_hash in enumerate(event.block_hashes):
            parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
            tokens = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
            for n in range(2):
                if tokens == prompt[n * BLOCK : (n + 1) * BLOCK]:
                    out[n] = (block_hash, parent)
    return out


def _complete(found: dict) -> bool:
    return all(len(_blocks(found, medium)) == 2 for medium in ("GPU", "CPU", "DISK"))


def report(found: dict) -> int:
    gpu, cpu, disk = (_blocks(found, medium) for medium in ("GPU", "CPU", "DISK"))
    print(f"vLLM's stream: {len(found['stored'])} BlockStored; the prompt's blocks by medium: "
          f"GPU {sorted(gpu)}, CPU {sorted(cpu)}, DISK {sorted(disk)}")
    problems = []
    if len(gpu) != 2:
        problems.append("vLLM did not announce the prompt's two GPU blocks")
    for medium, blocks in (("CPU", cpu), ("DISK", disk)):
        if blocks != gpu:
            problems.append(f"the connector's {medium} blocks {blocks} are not vLLM's {gpu}")
    for line in problems:
        print(f"FAILED: {line}")
    if not problems:
        print("PASSED: vLLM's own KV event stream carries the connector's CPU and DISK events of the saved prompt, "
              "under vLLM's block hashes and parents")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
