"""``make test-vllm``: the statetier connector under real vLLM engines (CPU), end to end.

Per model — an attention-only Llama and a GraniteMoeHybrid (Mamba2 + attention, prefix
caching off: ``mamba_cache_mode="none"``), both tiny, random-weight, made here — three
engine processes against one statetier daemon (a subprocess):

1. reference: no connector at all;
2. producer (``kv_producer``): prefills prompts A, B and C (288 tokens each), saving their
   attention blocks and, at every step that ends on a block end, their Mamba state;
3. consumer (``kv_consumer``), one request after another:
   - ``lookup``  — prompt A, no handoff: the joint-hit lookup restores 256 tokens;
   - ``handoff`` — prompt B with the producer's handoff (``kv_transfer_params``): by ref;
   - ``swapped`` — prompt A with a handoff of B's state (hybrid: A's refs with B's Mamba
     states; attention only: B's refs): must be refused, and vLLM recomputes;
   - ``stale``   — hybrid only: A's handoff whose Mamba refs name A's snapshot one step
     (128 tokens) earlier: must be refused, and vLLM recomputes;
   - ``control`` — hybrid only, the negative control: B's Mamba states put again *as C's*
     (a producer bug no identity can see), handed over with C's pages. It must load, and
     the tokens must then differ from the reference: the comparison sees a wrong Mamba state.

Passes only when every consumer request's greedy tokens equal the reference's, the
accepted loads wrote into the consumer's buffers exactly the bytes the producer saved
(BLAKE2b of every page and Mamba state, read from the engines' own buffers, through the
connector's audit log) and covered every layer, and the bad handoffs were refused with a
typed statetier reason, and the control's tokens differ. Exit status 0 on a pass, 1 otherwise.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from statetier.launch.daemons import DaemonProcess
from tests.vllm_e2e.tiny_models import VOCAB, write_granite_hybrid, write_llama

HERE = Path(__file__).resolve().parent

PROMPT_TOKENS = 288     # two full blocks of 128 and a partial third
RESTORED = 256
MAX_TOKENS = 12
ENGINE_TIMEOUT = 900
REFUSALS = {"position", "placement", "fingerprint", "stale", "misrouted", "namespace"}
PROMPT_OF = {"lookup": "A", "handoff": "B", "swapped": "A", "stale": "A", "control": "C"}


def prompts() -> dict[str, list[int]]:
    rng = random.Random(13)
    return {name: [rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)] for name in ("A", "B", "C")}


def run_engine(work: Path, label: str, spec: dict) -> dict:
    spec_path, out_path, log_path = work / f"{label}.spec.json", work / f"{label}.out.json", work / f"{label}.log"
    spec_path.write_text(json.dumps(spec))
    started = time.monotonic()
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, str(HERE / "engine_run.py"), str(spec_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT, cwd=work)
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise AssertionError(f"engine {label} exited with {done.returncode}; log tail:\n{tail}")
    out = json.loads(out_path.read_text())
    s = out["seconds"]
    print(f"  {label:<18} {time.monotonic() - started:6.1f} s (import {s['import']:.0f}, start {s['start']:.0f}, "
          f"generate {s['generate']:.1f})", flush=True)
    return {r["name"]: r for r in out["results"]}


def audit_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def of_request(record: dict, request_id: str) -> bool:
    """The engine's id of a request is the caller's id plus a random suffix (``0-8ff29d76``)."""
    return record["request"] == request_id or record["request"].startswith(request_id + "-")


def page_digests(records, event: str, request_id: str) -> dict[tuple, str]:
    return {(r["layer"], r["kind"], r["shard"], tuple(r["span"])): r["digest"]
            for r in records if r["event"] == event and of_request(r, request_id)}


def bad_handoffs(produced: dict, saves: list[dict], hybrid: bool) -> dict[str, dict]:
    """The swapped (and, for a hybrid, the one-step-stale) handoffs of prompt A."""
    a, b = produced["A"]["kv_transfer_params"], produced["B"]["kv_transfer_params"]
    if not hybrid:
        return {"swapped": copy.deepcopy(b)}
    swapped, stale = copy.deepcopy(a), copy.deepcopy(a)
    b_ssm = {r["key"]["layer"]: r for r in b["statetier"]["refs"] if r["key"]["kind"] == "ssm"}
    earlier = {r["ref"]["key"]["layer"]: r["ref"] for r in saves
               if r["event"] == "save" and of_request(r, produced["A"]["request_id"]) and r["kind"] == "ssm"
               and r["span"] == [0, RESTORED - 128]}
    for handoff, replacement in ((swapped, b_ssm), (stale, earlier)):
        refs = handoff["statetier"]["refs"]
        for i, ref in enumerate(refs):
            if ref["key"]["kind"] == "ssm":
                other = replacement[ref["key"]["layer"]]
                if handoff is swapped:
                    refs[i] = other                                   # B's Mamba state for A
                else:
                    # the ref still says 256 tokens, but names the object A's slot held one step earlier
                    refs[i] = {**ref, **{k: other[k] for k in ("state_id", "version", "request_id", "step")}}
    return {"swapped": swapped, "stale": stale}


def forged_handoff(daemon: DaemonProcess, produced: dict) -> dict:
    """C's handoff whose Mamba refs name B's states, sealed again under C's keys."""
    from statetier.clients import Client
    from statetier.protocol.identity import Namespace
    from statetier.protocol.messages import ref_from_wire, ref_to_wire

    forged = copy.deepcopy(produced["C"]["kv_transfer_params"])
    b_ssm = {r["key"]["layer"]: ref_from_wire(r) for r in produced["B"]["kv_transfer_params"]["statetier"]["refs"]
             if r["key"]["kind"] == "ssm"}
    refs = forged["statetier"]["refs"]
    with Client(daemon.url, namespace=Namespace.from_hex(refs[0]["key"]["ns"]), use_shm=False) as client:
        for i, ref in enumerate(refs):
            if ref["key"]["kind"] == "ssm":
                key = ref_from_wire(ref).key
                states = client.load(b_ssm[key.layer])
                refs[i] = ref_to_wire(client.put(key, states, request_id="forged-by-the-test", step=key.token_end))
    return forged


@dataclass
class Runs:
    """What the three engines of one model answered, and what their connectors logged."""

    reference: dict
    produced: dict
    saves: list[dict]
    consumed: dict = field(default_factory=dict)
    loads: list[dict] = field(default_factory=list)
    bad: dict = field(default_factory=dict)


def run_engines(work: Path, daemon: DaemonProcess, name: str, model_dir: Path, hybrid: bool) -> Runs:
    text = prompts()
    base = {"model": str(model_dir), "hybrid": hybrid}

    def connector(role: str) -> dict:
        return {"role": role, "extra": {"url": daemon.url, "tenant": "default",
                                        "audit_path": str(work / f"{name}-{role}.audit.jsonl")}}

    reference = run_engine(work, f"{name}-reference", {**base, "connector": None, "requests": [
        {"name": p, "prompt": text[p], "max_tokens": MAX_TOKENS} for p in text]})
    produced = run_engine(work, f"{name}-producer", {**base, "connector": connector("kv_producer"), "requests": [
        {"name": p, "prompt": text[p], "max_tokens": 2} for p in text]})
    runs = Runs(reference, produced, audit_records(work / f"{name}-kv_producer.audit.jsonl"))
    for p in text:
        handed = (produced[p]["kv_transfer_params"] or {}).get("statetier", {})
        if handed.get("tokens") != RESTORED:
            raise AssertionError(f"the producer's handoff of {p} covers {handed.get('tokens')} tokens, not {RESTORED}")
    runs.bad = bad_handoffs(produced, runs.saves, hybrid)
    requests = [{"name": "lookup", "prompt": text["A"], "max_tokens": MAX_TOKENS},
                {"name": "handoff", "prompt": text["B"], "max_tokens": MAX_TOKENS,
                 "params": produced["B"]["kv_transfer_params"]}]
    requests += [{"name": kind, "prompt": text["A"], "max_tokens": MAX_TOKENS, "params": params}
                 for kind, params in runs.bad.items()]
    if hybrid:
        requests.append({"name": "control", "prompt": text["C"], "max_tokens": MAX_TOKENS,
                         "params": forged_handoff(daemon, produced)})
    runs.consumed = run_engine(work, f"{name}-consumer", {**base, "connector": connector("kv_consumer"),
                                                          "requests": requests})
    runs.loads = audit_records(work / f"{name}-kv_consumer.audit.jsonl")
    return runs


def check_tokens(runs: Runs) -> list[str]:
    failures = []
    for case, out in runs.consumed.items():
        want = runs.reference[PROMPT_OF[case]]["tokens"]
        if case == "control":
            differ = out["tokens"] != want
            print(f"  {case:<8} tokens {'differ from' if differ else 'EQUAL'} the reference: {out['tokens']} "
                  f"(reference {want}; loaded {out['num_cached_tokens']} tokens with B's Mamba state)", flush=True)
            if not differ or out["num_cached_tokens"] != RESTORED:
                failures.append(f"{case}: a wrong Mamba state went unnoticed by the token comparison "
                                f"({out['num_cached_tokens']} tokens loaded)")
            continue
        same = out["tokens"] == want
        print(f"  {case:<8} tokens {'equal' if same else 'DIFFER from'} the reference: {out['tokens']}", flush=True)
        if not same:
            failures.append(f"{case}: tokens {out['tokens']} != reference {want}")
    if len(set(runs.reference["A"]["tokens"])) < 2:
        failures.append("the reference decodes one repeated token: the model is too degenerate to compare")
    return failures


def check_accepted(runs: Runs) -> list[str]:
    """The good loads: every layer's page and Mamba state, bytes equal to the producer's."""
    failures = []
    for case in ("lookup", "handoff"):
        rid = runs.consumed[case]["request_id"]
        produced_pages = page_digests(runs.saves, "save", runs.produced[PROMPT_OF[case]]["request_id"])
        wanted = {k: v for k, v in produced_pages.items()
                  if k[3][1] <= RESTORED and (k[1] == "kv" or k[3][1] == RESTORED)}
        loaded = page_digests(runs.loads, "load", rid)
        n_kv = sum(1 for k in loaded if k[1] == "kv")
        equal = bool(loaded) and loaded == wanted
        cached = runs.consumed[case]["num_cached_tokens"]
        print(f"  {case:<8} loaded {n_kv} KV pages + {len(loaded) - n_kv} Mamba states, "
              f"{'bytes equal to' if equal else 'NOT equal to'} the producer's {len(wanted)}; "
              f"vLLM skipped {cached} of {PROMPT_TOKENS} prompt tokens", flush=True)
        if cached != RESTORED:
            failures.append(f"{case}: vLLM counts {cached} cached tokens, not {RESTORED}")
        if not equal:
            failures.append(f"{case}: loaded pages {sorted(loaded)} differ from the producer's {sorted(wanted)}")
        refused = [r for r in runs.loads if r["event"] == "refused" and of_request(r, rid)]
        if refused:
            failures.append(f"{case}: a good load was refused: {refused}")
    return failures


def check_refused(runs: Runs) -> list[str]:
    """The mixed-up handoffs: a typed refusal, nothing written, everything recomputed."""
    failures = []
    for case in runs.bad:
        rid = runs.consumed[case]["request_id"]
        refused = [r for r in runs.loads if r["event"] == "refused" and of_request(r, rid)]
        wrote = [r for r in runs.loads if r["event"] == "load" and of_request(r, rid)]
        named = ", ".join(f"{r['error']} ({r['reason']})" for r in refused) or "NOT refused"
        cached = runs.consumed[case]["num_cached_tokens"]
        print(f"  {case:<8} refused: {named}; vLLM recomputed all {PROMPT_TOKENS} tokens (cached: {cached})",
              flush=True)
        if not refused or not {r["reason"] for r in refused} <= REFUSALS or wrote:
            failures.append(f"{case}: expected a typed refusal and nothing written, "
                            f"got {refused} / {len(wrote)} writes")
        if cached != 0:
            failures.append(f"{case}: vLLM counts {cached} tokens as cached after a refused load")
    return failures


def check_model(work: Path, daemon: DaemonProcess, name: str, model_dir: Path, hybrid: bool) -> list[str]:
    """Run the three engines of one model; the failures found (empty: a pass)."""
    what = "GraniteMoeHybrid (Mamba2 + attention), mamba_cache_mode=none" if hybrid else "Llama, attention only"
    print(f"{name}: {what}", flush=True)
    try:
        runs = run_engines(work, daemon, name, model_dir, hybrid)
    except AssertionError as exc:
        return [f"{name}: {exc}"]
    return [f"{name}/{failure}" for failure in check_tokens(runs) + check_accepted(runs) + check_refused(runs)]


def main() -> int:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="st-vllm-", dir="/tmp"))
    print(f"work folder: {work}", flush=True)
    models = {"llama": (write_llama(work / "llama"), False), "hybrid": (write_granite_hybrid(work / "hybrid"), True)}
    failures: list[str] = []
    with DaemonProcess(name="vllm", metrics=False, host_capacity="256MiB") as daemon:
        for name, (model_dir, hybrid) in models.items():
            failures += check_model(work, daemon, name, model_dir, hybrid)
        if failures:
            print(daemon.log_tail(3000))
    minutes = (time.monotonic() - started) / 60
    if failures:
        print(f"FAILED ({minutes:.1f} min); engine logs and audit logs kept in {work}:")
        for failure in failures:
            print(f"  - {failure}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print(f"PASSED: {len(models)} models, producer -> statetier -> consumer, tokens and bytes equal; "
          f"bad handoffs refused and recomputed ({minutes:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
