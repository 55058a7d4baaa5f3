"""Prefill/decode disaggregation of tiny hybrid models through two statetier daemons.

    python examples/pd_disaggregation.py --arch jamba [--arch bamba …] | --all
        [--redis-url URL] [--prompt-len 20] [--new-tokens 8] [--json FILE]

``PDCluster`` (``statetier.launch``) starts Redis, a shared keyring and two daemons.
Two worker processes (multiprocessing, spawn), each with its own daemon:

- the **prefill worker** builds the model (seed 0: same weights everywhere), prefills the
  prompt, saves the cache with ``save_cache(…, publish=True)`` (host arena, written
  through to Redis) and hands ``SavedState.to_json()`` and the first token to the decode
  worker over a queue;
- the **decode worker** builds the same model, asks its own daemon for the joint hit
  (``lookup_state``: every layer restorable at the prompt length, or nothing), restores
  the cache from the handed refs (``restore_cache``) and greedy-decodes.

The parent generates the reference in one process (no statetier) and compares.
``run_demo(archs, …)`` → ``[DemoResult]`` is what scripts/architecture_table.py and the
tests call. The report gives the tokens, the model's prefill time, the handoff time
(put + publish, lookup, load) and the bytes each daemon moved per tier and operation
(``statetier_bytes_total`` deltas). Exit status 1 when any tokens differ or a run fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from statetier.launch import PDCluster  # noqa: E402
from tiny_hybrids import ARCHITECTURES, UnavailableArch  # noqa: E402

RESULT_TIMEOUT_S = 300.0
#: Every process computes with one thread: the same reduction order everywhere, and tiny
#: models run several times faster than with threads fighting over two cores.
THREADS = 1


@dataclass
class DemoResult:
    arch: str
    display: str
    attention_layers: list[int] = field(default_factory=list)
    ssm_layers: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)
    restorable: int = 0
    state_bytes: int = 0
    prefill_ms: float = 0.0
    put_ms: float = 0.0
    lookup_ms: float = 0.0
    load_ms: float = 0.0
    counters: dict = field(default_factory=dict)  # daemon → {"bytes host/put": n, "hits redis": n, …}
    skipped: str = ""
    error: str = ""

    @property
    def equal(self) -> bool:
        return not self.error and not self.skipped and bool(self.tokens) and self.tokens == self.reference

    @property
    def handoff_ms(self) -> float:
        return self.put_ms + self.lookup_ms + self.load_ms


# -- the workers (separate processes) ------------------------------------------------------


def _model(models: dict, arch: str):
    """The worker's copy of ``arch``, warmed by one untimed prefill (first calls are slow)."""
    from tiny_hybrids import build_model, prefill, prompt

    if arch not in models:
        models[arch] = build_model(arch, seed=0)
        prefill(models[arch], prompt(seed=99, length=8))
    return models[arch]


def prefill_worker(jobs, handoffs) -> None:
    """Prefill each job's prompt, publish the state, hand the refs to the decode side."""
    import transformers  # noqa: F401 - imported before the first job, not during it

    from statetier.clients import Client
    from statetier.clients.transformers import namespace_for, save_cache
    from tiny_hybrids import prefill

    torch.set_num_threads(THREADS)
    models: dict = {}
    for job in iter(jobs.get, None):
        out = {"arch": job["arch"], "request_id": job["request_id"], "prompt": job["prompt"],
               "decode_url": job["decode_url"]}
        try:
            model = _model(models, job["arch"])
            started = time.perf_counter()
            cache, first = prefill(model, job["prompt"])
            out["prefill_ms"] = (time.perf_counter() - started) * 1e3
            with Client(job["prefill_url"], namespace=namespace_for(model)) as client:
                started = time.perf_counter()
                saved = save_cache(client, model, cache, job["prompt"], request_id=job["request_id"], publish=True)
                out["put_ms"] = (time.perf_counter() - started) * 1e3
            out["state_bytes"] = _state_bytes(model, cache, len(job["prompt"]))
            out.update(first_token=first, saved=saved.to_json())
        except Exception as exc:  # noqa: BLE001 - reported to the parent, the worker goes on
            out["error"] = f"prefill: {type(exc).__name__}: {exc}"
        handoffs.put(out)


def decode_worker(handoffs, results, new_tokens: int) -> None:
    """Look the handed state up in this side's daemon, restore it, decode greedily."""
    import transformers  # noqa: F401

    from statetier.clients import Client
    from statetier.clients.transformers import SavedState, lookup_state, namespace_for, restore_cache
    from tiny_hybrids import greedy_decode

    torch.set_num_threads(THREADS)
    models: dict = {}
    for handoff in iter(handoffs.get, None):
        out = {k: v for k, v in handoff.items() if k not in ("saved", "prompt", "decode_url")}
        if "error" in handoff:
            results.put(out)
            continue
        prompt = handoff["prompt"]
        try:
            model = _model(models, handoff["arch"])
            with Client(handoff["decode_url"], namespace=namespace_for(model)) as client:
                started = time.perf_counter()
                hit = lookup_state(client, model, prompt)
                out["lookup_ms"] = (time.perf_counter() - started) * 1e3
                out["restorable"] = hit.tokens
                try:
                    if hit.tokens != len(prompt):
                        raise RuntimeError(f"joint hit covers {hit.tokens} of {len(prompt)} tokens")
                    started = time.perf_counter()
                    cache = restore_cache(client, model, SavedState.from_json(handoff["saved"]), prompt)
                    out["load_ms"] = (time.perf_counter() - started) * 1e3
                finally:
                    client.release(hit.lease_ids)
            out["tokens"] = greedy_decode(model, cache, handoff["first_token"], len(prompt), new_tokens)
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"decode: {type(exc).__name__}: {exc}"
        results.put(out)


def _state_bytes(model, cache, tokens: int) -> int:
    """Payload bytes of the saved state: every KV record and SSM snapshot."""
    from statetier.clients.transformers import cache_plan, kv_tensors, ssm_tensors

    total = 0
    for plan in cache_plan(model.config).layers:
        layer = cache.layers[plan.index]
        tensors = [*kv_tensors(plan.index, layer, tokens).values()] if plan.has_kv else []
        tensors += [*ssm_tensors(plan.index, layer, tokens).values()] if plan.has_ssm else []
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


# -- the parent ----------------------------------------------------------------------------


def run_demo(archs: list[str], *, redis_url: str | None = None, prompt_len: int = 20,
             new_tokens: int = 8, log=print) -> list[DemoResult]:
    """Run the PD handoff for each architecture; one cluster and one pair of workers for all."""
    context = multiprocessing.get_context("spawn")
    torch.set_num_threads(THREADS)
    jobs, handoffs, answers = context.Queue(), context.Queue(), context.Queue()
    workers = [context.Process(target=prefill_worker, args=(jobs, handoffs), daemon=True, name="prefill-worker"),
               context.Process(target=decode_worker, args=(handoffs, answers, new_tokens), daemon=True,
                               name="decode-worker")]
    for worker in workers:  # they import torch and transformers while the daemons start
        worker.start()
    try:
        with PDCluster(redis_url) as cluster:
            try:
                pipeline = _Pipeline(cluster, jobs, answers, workers)
                return [_run_one(pipeline, arch, prompt_len, new_tokens, log) for arch in archs]
            finally:  # the workers wind down while the daemons stop
                jobs.put(None)
                handoffs.put(None)
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.terminate()
                worker.join()


@dataclass
class _Pipeline:
    cluster: PDCluster
    jobs: object
    answers: object
    workers: list
    warmed: bool = False

    def handoff(self, arch: str, prompt: list[int]) -> dict:
        """One request through both workers; fails fast when a worker process died."""
        self.jobs.put({"arch": arch, "prompt": prompt, "request_id": f"pd-{arch}-{uuid.uuid4().hex[:8]}",
                       "prefill_url": self.cluster.prefill.url, "decode_url": self.cluster.decode.url})
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return self.answers.get(timeout=1.0)
            except queue.Empty:
                dead = [w.name for w in self.workers if not w.is_alive()]
                if dead:
                    raise RuntimeError(f"worker process(es) {dead} exited") from None
        raise TimeoutError(f"no answer for {arch} within {RESULT_TIMEOUT_S} s")


def _run_one(pipeline: _Pipeline, arch: str, prompt_len: int, new_tokens: int, log) -> DemoResult:
    from statetier.clients.transformers import cache_plan
    from tiny_hybrids import build_model, prompt as make_prompt, reference_tokens

    result = DemoResult(arch, ARCHITECTURES[arch].display)
    prompt = make_prompt(seed=1, length=prompt_len)
    try:
        model = build_model(arch, seed=0)
        plan = cache_plan(model.config)
        result.attention_layers, result.ssm_layers = plan.attention_layers, plan.ssm_layers
        result.reference = reference_tokens(model, prompt, new_tokens)
    except UnavailableArch as exc:
        result.skipped = str(exc)
    except Exception as exc:  # noqa: BLE001 - a family this transformers cannot run on CPU
        result.skipped = f"does not run here without statetier either: {type(exc).__name__}: {exc}"
    if result.skipped:
        log(format_result(result))
        return result
    if not pipeline.warmed:  # the first handoff also opens Redis connections: keep it out of the timings
        pipeline.handoff(arch, make_prompt(seed=98, length=prompt_len))
        pipeline.warmed = True
    daemons = (pipeline.cluster.prefill, pipeline.cluster.decode)
    before = {d.name: d.counters() for d in daemons}
    answer = pipeline.handoff(arch, prompt)
    result.counters = {d.name: _delta(before[d.name], d.counters()) for d in daemons}
    for name in ("tokens", "restorable", "state_bytes", "prefill_ms", "put_ms", "lookup_ms", "load_ms", "error"):
        if name in answer:
            setattr(result, name, answer[name])
    log(format_result(result))
    return result


def _delta(before: dict, after: dict) -> dict[str, int]:
    return {key: value - before.get(key, 0) for key, value in sorted(after.items()) if value != before.get(key, 0)}


def _per_daemon(counters: dict, show) -> str:
    parts = []
    for daemon, per in counters.items():
        shown = [text for text in (show(k, v) for k, v in per.items()) if text]
        if shown:
            parts.append(f"{daemon} daemon " + ", ".join(shown))
    return "; ".join(parts) or "-"


def format_result(r: DemoResult) -> str:
    if r.skipped:
        return f"{r.arch}: skipped ({r.skipped})"
    head = (f"{r.display}: {len(r.attention_layers)} attention + {len(r.ssm_layers)} SSM layers, "
            f"state {r.state_bytes / 1024:.1f} KiB")
    if r.error:
        return f"{head}\n  FAILED: {r.error}"
    verdict = "equal to the reference" if r.equal else f"DIFFERENT from the reference {r.reference}"
    moved = _per_daemon(r.counters, lambda k, v: f"{k.removeprefix('bytes ')} {v / 1024:.1f} KiB"
                        if k.startswith("bytes ") else None)
    served = _per_daemon(r.counters, lambda k, v: None if k.startswith("bytes ") else f"{k} {v}")
    return (f"{head}\n  tokens  : {r.tokens} {verdict}\n"
            f"  prefill : {r.prefill_ms:.1f} ms (model)\n"
            f"  handoff : {r.handoff_ms:.1f} ms = put+publish {r.put_ms:.1f} + lookup {r.lookup_ms:.1f} "
            f"+ load {r.load_ms:.1f} (joint hit {r.restorable} tokens)\n"
            f"  bytes   : {moved}\n"
            f"  loads   : {served}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=sorted(ARCHITECTURES), help="architecture (repeatable)")
    parser.add_argument("--all", action="store_true", help="every architecture")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--prompt-len", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--json", metavar="FILE", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    archs = list(ARCHITECTURES) if args.all else (args.arch or [])
    if not archs:
        parser.error("name an --arch or pass --all")
    results = run_demo(archs, redis_url=args.redis_url, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "equal": r.equal} for r in results], indent=2))
    failed = [r.arch for r in results if not r.equal and not (r.skipped and args.all)]
    print(f"\n{len(results) - len(failed)}/{len(results)} architectures: decode tokens equal the reference"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
