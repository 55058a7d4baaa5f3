"""The statetier connector measured inside vLLM (CPU build; opt-in: needs ``.venv-vllm``).

    .venv-vllm/bin/python -m statetier.benchmarks.workload_vllm [--tokens 4096] [--out FILE.json]

A random-weight GraniteMoeHybrid (Mamba2 + attention, float32; its parameter count is
printed), made here, served by three engine processes against one statetier daemon:

1. ``plain`` (no connector): prefills the producer's prompts (prompt tokens/s), then
   recomputes prompt R (its TTFT), and gives every prompt's reference tokens;
2. ``producer`` (``kv_producer``): the same prompts, saving (prompt tokens/s with the
   connector: ``producer_ratio`` = with / without, target ≥ 0.95), then R;
3. ``consumer`` (``kv_consumer``): R restored from the daemon (its TTFT:
   ``ttft_ratio`` = restore / recompute, target ≤ 0.3 at 4k tokens), tokens equal to the
   reference; R again with the daemon SIGSTOPped (computed here; ``stalled_worst_step_s``,
   against the deadline); 8 requests at once, half of them hits (their TTFT and tokens).

Every engine: block 128, chunks of 128 tokens (a producer's steps end on block ends),
prefix caching off, ``mamba_cache_mode="none"``, and the same OpenMP binding: vLLM's CPU
worker reserves one core more for an engine with a KV connector than for one without, and on
a machine of two cores reserves none at all, binding OpenMP to both (its second thread then
waits out every other process on that core at each barrier: the producer ran at 0.08 of the
plain engine at load 17), so ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is set alike for all of them
(``--reserved-cpus``, default 1: OpenMP on the first cores, the last one for the scheduler
process, the connector's threads and the daemon; ``auto`` leaves vLLM's choice). Figures are wall seconds on a shared
machine: the load average is recorded beside them; compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 128
VOCAB = 512
DEADLINE = 5.0
CONCURRENT = 8


def write_model(path: Path, *, hidden: int, layers: int, seed: int = 7) -> int:
    """The hybrid's weights into ``path``; returns its parameter count."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, shared_intermediate_size=2 * hidden,
        num_local_experts=0, num_experts_per_tok=0, num_hidden_layers=layers,
        layer_types=["mamba" if i % 2 == 0 else "attention" for i in range(layers)],
        num_attention_heads=hidden // 128, num_key_value_heads=2, max_position_embeddings=16384,
        position_embedding_type="rope", initializer_range=0.05, mamba_n_heads=16, mamba_d_head=hidden * 2 // 16,
        mamba_n_groups=1, mamba_d_state=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = GraniteMoeHybridForCausalLM(config).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------- one engine process


def engine_main(spec_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    options = dict(model=spec["model"], skip_tokenizer_init=True, dtype="float32", max_model_len=spec["tokens"] + 64,
                   block_size=BLOCK, max_num_batched_tokens=BLOCK, enable_chunked_prefill=True,
                   enable_prefix_caching=False, max_num_seqs=CONCURRENT, seed=0, mamba_cache_mode="none")
    if spec["role"]:
        options["kv_transfer_config"] = KVTransferConfig(
            kv_connector="StatetierConnector", kv_connector_module_path="statetier.clients.vllm",
            kv_role=spec["role"], kv_load_failure_policy="recompute",
            kv_connector_extra_config={"url": spec["url"], "deadline": DEADLINE, "allow_unidentified_weights": True})
    llm = LLM(**options)
    engine = llm.llm_engine
    out: dict = {"phases": {}}
    for phase in spec["phases"]:
        params = SamplingParams(max_tokens=phase["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
        if phase.get("stop_daemon"):
            os.kill(phase["stop_daemon"], signal.SIGSTOP)
        try:
            out["phases"][phase["name"]] = run_phase(engine, phase, params, TokensPrompt)
        finally:
            if phase.get("stop_daemon"):
                os.kill(phase["stop_daemon"], signal.SIGCONT)
                time.sleep(2.0)  # its late answers arrive: the connector trusts the daemon again
    Path(out_path).write_text(json.dumps(out))


def run_phase(engine, phase: dict, params, prompt_cls) -> dict:
    """Every prompt of the phase added at once (or one after another), stepped to the end:
    seconds, tokens, TTFT and cached tokens per request, the longest step."""
    started = time.monotonic()
    requests: dict[str, dict] = {}
    longest = 0.0
    batches = [phase["prompts"]] if phase.get("together") else [[p] for p in phase["prompts"]]
    for batch in batches:
        begun = time.monotonic()
        for name, prompt in batch:
            engine.add_request(f"{phase['name']}-{name}", prompt_cls(prompt_token_ids=prompt), params)
            requests[name] = {"added": begun}
        while engine.has_unfinished_requests():
            before = time.monotonic()
            outputs = engine.step()
            now = time.monotonic()
            longest = max(longest, now - before)
            for output in outputs:
                name = output.request_id.split("-")[1]  # "<phase>-<name>", maybe with vLLM's suffix
                done = requests[name]
                if "ttft" not in done and output.outputs and output.outputs[0].token_ids:
                    done["ttft"] = now - done["added"]
                if output.finished:
                    done.update(tokens=list(output.outputs[0].token_ids), cached=output.num_cached_tokens,
                                seconds=now - done["added"])
    return {"seconds": time.monotonic() - started, "longest_step": longest,
            "requests": {n: {k: v for k, v in r.items() if k != "added"} for n, r in requests.items()}}


# ------------------------------------------------------------------------------- the workload


def run_engine(work: Path, label: str, spec: dict) -> dict:
    spec_path, out_path = work / f"{label}.spec.json", work / f"{label}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    if spec["reserved_cpus"] != "auto":  # "auto": vLLM's own binding, which differs with a connector
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = spec["reserved_cpus"]
    with open(work / f"{label}.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "statetier.benchmarks.workload_vllm", "--engine", str(spec_path),
                               str(out_path)], stdout=log, stderr=subprocess.STDOUT, timeout=3600, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"engine {label} exited {done.returncode}: {(work / f'{label}.log').read_text()[-3000:]}")
    return json.loads(out_path.read_text())["phases"]


def producer_only(tokens: int, hidden: int, layers: int, work: Path, prompts: int, reserved_cpus: str) -> dict:
    """Only the producer's phase, without and with the connector (same prompts): its ratio."""
    from statetier.launch.daemons import DaemonProcess

    params = write_model(work / "model", hidden=hidden, layers=layers)
    rng = random.Random(22)
    produce = {"name": "produce", "max_tokens": 1,
               "prompts": [(f"P{i}", [rng.randrange(1, VOCAB) for _ in range(tokens)]) for i in range(prompts)]}
    base = {"model": str(work / "model"), "tokens": tokens, "reserved_cpus": reserved_cpus}
    with DaemonProcess(name="vllmbench", metrics=False, host_capacity="4GiB") as daemon:
        plain = run_engine(work, "plain", {**base, "role": None, "phases": [produce]})
        produced = run_engine(work, "producer", {**base, "role": "kv_producer", "url": daemon.url, "phases": [produce]})
    n_prompt_tokens = tokens * prompts
    return {"params": params, "tokens": tokens, "prompts": prompts, "reserved_cpus": reserved_cpus,
            "loadavg": os.getloadavg(),
            "plain_tokens_per_s": n_prompt_tokens / plain["produce"]["seconds"],
            "producer_tokens_per_s": n_prompt_tokens / produced["produce"]["seconds"],
            "producer_ratio": plain["produce"]["seconds"] / produced["produce"]["seconds"]}


def workload(tokens: int, hidden: int, layers: int, work: Path, reserved_cpus: str) -> dict:
    from statetier.launch.daemons import DaemonProcess

    params = write_model(work / "model", hidden=hidden, layers=layers)
    rng = random.Random(22)
    prompt = {f"P{i}": [rng.randrange(1, VOCAB) for _ in range(tokens)] for i in range(CONCURRENT + 1)}
    saved = [f"P{i}" for i in range(CONCURRENT // 2)]                # the producer's: hits later
    fresh = [f"P{i}" for i in range(CONCURRENT // 2, CONCURRENT)]    # never saved: misses
    restored = f"P{CONCURRENT}"                                      # R
    base = {"model": str(work / "model"), "tokens": tokens, "reserved_cpus": reserved_cpus}
    produce = {"name": "produce", "max_tokens": 1, "prompts": [(p, prompt[p]) for p in saved]}
    with DaemonProcess(name="vllmbench", metrics=False, host_capacity="4GiB") as daemon:
        plain = run_engine(work, "plain", {**base, "role": None, "phases": [
            produce, {"name": "recompute", "max_tokens": 8, "prompts": [(restored, prompt[restored])]},
            {"name": "reference", "max_tokens": 8, "prompts": [(p, prompt[p]) for p in saved + fresh]}]})
        produced = run_engine(work, "producer", {**base, "role": "kv_producer", "url": daemon.url, "phases": [
            produce, {"name": "save", "max_tokens": 1, "prompts": [(restored, prompt[restored])]}]})
        half = [(p, prompt[p]) for pair in zip(saved, fresh) for p in pair]
        consumed = run_engine(work, "consumer", {**base, "role": "kv_consumer", "url": daemon.url, "phases": [
            {"name": "restore", "max_tokens": 8, "prompts": [(restored, prompt[restored])]},
            {"name": "stalled", "max_tokens": 8, "prompts": [(restored, prompt[restored])], "stop_daemon": daemon.pid},
            {"name": "concurrent", "max_tokens": 8, "prompts": half, "together": True}]})
    return {**figures(params, tokens, plain, produced, consumed, prompt), "reserved_cpus": reserved_cpus}


def figures(params: int, tokens: int, plain: dict, produced: dict, consumed: dict, prompt: dict) -> dict:
    reference = {**plain["reference"]["requests"], **plain["recompute"]["requests"]}
    restore = consumed["restore"]["requests"]
    (name,) = restore
    recompute_ttft = plain["recompute"]["requests"][name]["ttft"]
    concurrent = consumed["concurrent"]["requests"]
    n_prompt_tokens = tokens * len(plain["produce"]["requests"])
    return {
        "params": params, "tokens": tokens, "loadavg": os.getloadavg(),
        "plain_tokens_per_s": n_prompt_tokens / plain["produce"]["seconds"],
        "producer_tokens_per_s": n_prompt_tokens / produced["produce"]["seconds"],
        "producer_ratio": plain["produce"]["seconds"] / produced["produce"]["seconds"],
        "recompute_ttft_s": recompute_ttft, "restore_ttft_s": restore[name]["ttft"],
        "ttft_ratio": restore[name]["ttft"] / recompute_ttft,
        "restored_tokens": restore[name]["cached"],
        "restore_tokens_equal": restore[name]["tokens"] == reference[name]["tokens"],
        "stalled_worst_step_s": consumed["stalled"]["longest_step"],
        "stalled_tokens_equal": consumed["stalled"]["requests"][name]["tokens"] == reference[name]["tokens"],
        "stalled_cached": consumed["stalled"]["requests"][name]["cached"],
        "deadline_s": DEADLINE,
        "concurrent_seconds": consumed["concurrent"]["seconds"],
        "concurrent_hits": sum(1 for r in concurrent.values() if r["cached"] > 0),
        "concurrent_ttft_s": {n: round(r["ttft"], 3) for n, r in sorted(concurrent.items())},
        "concurrent_tokens_equal": all(r["tokens"] == reference[n]["tokens"] for n, r in concurrent.items()),
    }


def summary_line(f: dict) -> str:
    return (f"workload_vllm ({f['params'] / 1e6:.0f}M-parameter hybrid, {f['tokens']} tokens, load "
            f"{f['loadavg'][0]:.1f}): producer ratio {f['producer_ratio']:.2f} "
            f"({f['producer_tokens_per_s']:.0f} vs {f['plain_tokens_per_s']:.0f} tokens/s); restore/recompute TTFT "
            f"{f['ttft_ratio']:.2f} ({f['restore_ttft_s']:.2f} s vs {f['recompute_ttft_s']:.2f} s, tokens "
            f"{'equal' if f['restore_tokens_equal'] else 'DIFFER'}); stalled daemon worst step "
            f"{f['stalled_worst_step_s']:.2f} s (deadline {f['deadline_s']} s); {CONCURRENT} concurrent: "
            f"{f['concurrent_hits']} hits in {f['concurrent_seconds']:.1f} s, tokens "
            f"{'equal' if f['concurrent_tokens_equal'] else 'DIFFER'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reserved-cpus", default="1",
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine (the same OpenMP binding for all), "
                             "or 'auto': vLLM's own choice per engine")
    parser.add_argument("--producer-only", type=int, metavar="PROMPTS",
                        help="only the producer's phase of PROMPTS prompts, without and with the connector")
    args = parser.parse_args()
    if args.engine:
        engine_main(*args.engine)
        return 0
    work = Path(tempfile.mkdtemp(prefix="st-vllm-bench-", dir="/tmp"))
    if args.producer_only:
        result = producer_only(args.tokens, args.hidden, args.layers, work, args.producer_only, args.reserved_cpus)
        print(json.dumps(result, indent=1))
        print(f"producer only ({args.producer_only} x {args.tokens} tokens, load {result['loadavg'][0]:.1f}): "
              f"ratio {result['producer_ratio']:.2f} ({result['producer_tokens_per_s']:.0f} vs "
              f"{result['plain_tokens_per_s']:.0f} tokens/s)")
        return 0
    result = workload(args.tokens, args.hidden, args.layers, work, args.reserved_cpus)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(summary_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
