"""One vLLM engine in its own process: run a list of token-id prompts greedily, write the outputs.

    python -m tests.vllm_e2e.engine_run SPEC.json OUT.json   (the checkout on PYTHONPATH: run_e2e.child_env)

SPEC: ``model`` (folder), ``hybrid`` (bool), ``align`` (bool: prefix caching, ``mamba_cache_mode="align"``; ``chunk``: tokens per step, default one block), ``tp`` (tensor parallel size, default 1), ``connector`` (null for a run without any
connector, ``{"role": "kv_producer" | "kv_consumer", "extra": {...}}``, or ``{"multi":
[{"kv_connector", "kv_connector_module_path"?, "kv_role", "kv_connector_extra_config"}, ...]}``
for vLLM's ``MultiConnector``) and ``requests``: ``[{"name", "prompt": [ids], "max_tokens",
"params": kv_transfer_params or null, "cache_salt": str or absent, "stop_daemon": pid or absent}]``, run one after
another, each through the engine's own step loop; with ``stop_daemon`` the daemon is
SIGSTOPped for that request (and SIGCONTed after). OUT: per request ``name``,
``request_id``, ``tokens``, ``kv_transfer_params``, ``num_cached_tokens``, ``seconds`` (to
its end), ``max_step_seconds`` (the longest ``LLMEngine.step`` call while it ran: the wait
for the engine core's next output, so a request waiting for its lookup counts that wait in
it); and the engine's block size.

Every engine: float32, ``block_size=128``, chunks of at most 128 tokens (so a hybrid
producer's steps end on block ends, where Mamba state is saved), prefix caching off
(a consumer must load, not hit its own cache), ``VLLM_CPU_KVCACHE_SPACE=1``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK = 128


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    imported = time.monotonic()
    options = dict(model=spec["model"], skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
                   block_size=BLOCK, max_num_batched_tokens=BLOCK, enable_chunked_prefill=True,
                   enable_prefix_caching=False, max_num_seqs=4, seed=0)
    if spec["hybrid"]:
        options["mamba_cache_mode"] = "none"
    if spec.get("align"):  # prefix caching on a hybrid: vLLM's "align" mode, chunks of ``chunk`` tokens
        options.update(mamba_cache_mode="align", enable_prefix_caching=True,
                       max_num_batched_tokens=spec.get("chunk", BLOCK))
    if spec.get("tp", 1) > 1:
        options["tensor_parallel_size"] = spec["tp"]
    connector = spec["connector"]
    if connector is not None and "multi" in connector:
        options["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"connectors": connector["multi"]})
    elif connector is not None:
        options["kv_transfer_config"] = KVTransferConfig(
            kv_connector="StatetierConnector", kv_connector_module_path="statetier.clients.vllm",
            kv_role=connector["role"], kv_load_failure_policy="recompute",
            kv_connector_extra_config=connector["extra"])
    llm = LLM(**options)
    ready = time.monotonic()
    results = []
    for n, request in enumerate(spec["requests"]):
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                                extra_args={"kv_transfer_params": request["params"]} if request.get("params") else None)
        prompt = TokensPrompt(prompt_token_ids=request["prompt"])
        if request.get("cache_salt"):  # vLLM folds it into the first block's hash; the connector too
            prompt["cache_salt"] = request["cache_salt"]
        stopped = request.get("stop_daemon")
        if stopped:
            os.kill(stopped, signal.SIGSTOP)
        try:
            output, seconds, longest = run_one(llm, f"{n}-{request['name']}", prompt, params)
        finally:
            if stopped:
                os.kill(stopped, signal.SIGCONT)
        results.append({"name": request["name"], "request_id": output.request_id,
                        "tokens": list(output.outputs[0].token_ids),
                        "kv_transfer_params": output.kv_transfer_params,
                        "num_cached_tokens": output.num_cached_tokens,
                        "seconds": seconds, "max_step_seconds": longest})
    done = time.monotonic()
    with open(out_path, "w") as out:
        json.dump({"block_size": llm.llm_engine.vllm_config.cache_config.block_size, "results": results,
                   "seconds": {"import": imported - started, "start": ready - imported, "generate": done - ready}},
                  out, indent=1)


def run_one(llm, request_id: str, prompt, params):
    """One request through the engine's step loop: its output, its seconds, its longest step."""
    engine = llm.llm_engine
    started = time.monotonic()
    engine.add_request(request_id, prompt, params)
    longest, output = 0.0, None
    while engine.has_unfinished_requests():
        before = time.monotonic()
        for out in engine.step():
            if out.finished:
                output = out
        longest = max(longest, time.monotonic() - before)
    return output, time.monotonic() - started, longest


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
