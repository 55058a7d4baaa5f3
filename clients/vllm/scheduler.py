"""The scheduler side of the vLLM connector, as a plain class (no vLLM import).

``SchedulerSide(cfg, layout, spec, *, tp_size, loads, saves, saves_decode, drops_last_block,
hands_off)``;
the vLLM adapter calls, in vLLM's order:

- ``matched_tokens(request, num_computed)`` — how many tokens beyond ``num_computed`` the
  engine may skip, or ``None`` while the daemon's answer is on its way (vLLM asks again
  next step). A block is keyed by its tokens and by what else vLLM folds into its hash
  (``extra_keys.py``: LoRA adapter, multimodal inputs, ``cache_salt``, prompt embeddings);
  what cannot be keyed is a counted miss (``misses.unkeyed_<field>``) and is never saved.
  From a handoff in ``request.kv_transfer_params`` (the producer's refs: no daemon call; one of
  another salt, adapter, image or embeddings is refused by that name, ``misses.handoff_<field>``;
  one whose refs cover less than the producer saved, by its own word, is looked up instead), else from the
  daemon's joint-hit ``lookup`` over every KV cache group's group objects (``groups=``) at the
  attention block ends and every TP shard (``tp_size``; a replicated Mamba group's one object,
  shard 0: ``group_shards=``); when that finds nothing, over per-layer
  objects (what producers saved before group objects). Started on the first call and never
  waited on: not answered within ``cfg.deadline`` it is a miss (counted). Never the whole
  prompt (vLLM computes at least one token), one answer per request (cached), 0 once a load of
  this request was tried; with ``drops_last_block`` (EAGLE) a hit's last block is dropped, as
  vLLM drops it from its own hits.
- ``after_alloc(request, block_ids, num_external)`` — with the block ids per cache group, a
  ``LoadJob``: one expected ref per object into its block (attention) or slot (Mamba).
- ``saving_request(request_id)`` — the tracked request of a producer (its steps feed ``build_meta``).
- ``build_meta(steps, preempted=())`` → ``StepMeta``: the pending loads, the saves of this
  step for producers (one group object per attention group for every block of the prompt
  the step completes, and one per Mamba group when the step ends on a block end of the
  prompt: ``tokens_absorbed`` = that end; with ``saves_decode``, of the decoded tokens too,
  for a next turn), and the preempted requests whose saves the workers flush.
- ``refs_saved(by_request)`` — the refs the workers' saves were answered with (vLLM's worker
  metadata, every rank's): what a handoff names.
- ``loads_finished(request_ids)`` — the workers are done with these loads: leases released.
- ``hit_source(request_id)`` — where its hit comes from (vLLM's ``CacheHitSource``: ``p2p``, ``host``).
- ``reset_cache()`` — this namespace's objects purged from the daemon.
- ``request_finished(request)`` → ``(delay_free, kv_transfer_params)``: ``delay_free`` when
  saves of the request were scheduled (the workers report it in ``finished_sending`` once
  they are done, and vLLM keeps its blocks until then); the handoff (producers, with
  ``hands_off``: ``contract.returns_handoff``, so ``kv_both`` returns none to end users) or
  ``None``, built from ``refs_saved`` with no daemon call (``handoff.py``); its cost is counted
  (``calls.request_finished``, ``scheduler_seconds.request_finished``).
- ``counts`` — ``stats.ConnectorCounts``: lookups, hits, misses by reason, deadline misses.
- ``take_events()`` / ``events_topic(template)`` — the daemon's KV events of the blocks this
  side saved, named by vLLM's block hashes (``events.py``); the topic of this side's namespace.
- ``close()``.

``request``: anything with ``request_id``, ``prompt_token_ids`` (``None`` with
``prompt_embeds``), ``kv_transfer_params`` and optionally ``cache_salt``, ``lora_request``,
``mm_features``, ``prompt_embeds`` (vLLM's ``Request``, or a plain object in tests).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from statetier.protocol.errors import ClientClosedError, InvalidRequest, StatetierError
from statetier.protocol.identity import Kind, NamespaceSpec, StateKey, StateRef

from .extra_keys import AdapterIdentities, RequestKeys, other_field, request_keys, unkeyed_field
from .handoff import Spans, span_of
from .jobs import Handoff, LoadItem, LoadJob, StepMeta, handoff_from_params
from .producer import Producer, ScheduledStep
from .layout import ConnectorConfig, EngineLayout
from .link import DaemonLink
from .stats import ConnectorCounts, reason_of

log = logging.getLogger("statetier.vllm")

#: what a daemon call may end with that is the daemon's (or its connection's) doing: a miss
_DAEMON_FAILURES = (StatetierError, OSError, ClientClosedError, concurrent.futures.CancelledError)


@dataclass
class _Plan:
    tokens: int = 0
    refs: list[StateRef] = field(default_factory=list)   # expected refs, every shard
    leases: list[int] = field(default_factory=list)
    local: int = 0                                       # num_computed when asked
    source: str = "host"                                 # vLLM's CacheHitSource: "p2p" for a handoff


@dataclass
class _Asking:
    """A lookup on its way: the daemon's answer, when it was asked, the prompt's hashes."""

    future: concurrent.futures.Future
    started: float
    hashes: list[bytes]
    by_layer: bool = False  # the second lookup: per-layer objects


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, layout: EngineLayout, spec: NamespaceSpec, *, tp_size: int = 1,
                 loads: bool = True, saves: bool = True, saves_decode: bool = False,
                 drops_last_block: bool = False, hands_off: bool = True) -> None:
        self.cfg, self.layout, self.spec = cfg, layout, spec
        self.hands_off = hands_off  # the handoff in kv_transfer_params (``contract.returns_handoff``)
        self.namespace = spec.namespace()
        self.tp_size = tp_size
        self.does_load, self.does_save = loads, saves
        self.drops_last_block = drops_last_block
        self.spans = Spans(layout, tp_size)
        self.adapters = AdapterIdentities(cfg.allow_unidentified_weights)
        self.link = DaemonLink(cfg, spec, use_shm=False)
        self.counts = ConnectorCounts()
        self._keys: dict[str, RequestKeys | InvalidRequest] = {}
        self._asking: dict[str, _Asking] = {}
        self._plans: dict[str, _Plan] = {}
        self._tried: set[str] = set()
        self._sources: dict[str, str] = {}
        self._leases: dict[str, list[int]] = {}
        self.producer = Producer(layout, self.namespace, self.spans, self.counts, self._hashes,
                                 saves_decode=saves_decode)
        self._pending: list[LoadJob] = []
        self.events = None  # the connector sets an ``events.ConnectorEvents`` (``connector.connector_events``)

    @property
    def saves_decode(self) -> bool:
        """Whether decoded tokens' blocks are saved too (the producer's setting)."""
        return self.producer.saves_decode

    @saves_decode.setter
    def saves_decode(self, value: bool) -> None:
        self.producer.saves_decode = value

    # -- identity -------------------------------------------------------------------------

    def _request_keys(self, request) -> RequestKeys:
        """The request's extra keys, derived once; ``InvalidRequest`` (remembered) when they cannot be."""
        rid = request.request_id
        known = self._keys.get(rid)
        if known is None:
            try:
                known = request_keys(request, self.adapters)
            except InvalidRequest as exc:
                log.warning("statetier: request %s is not keyed (%s): computed here, not saved", rid, exc)
                known = exc
            self._keys[rid] = known
        if isinstance(known, InvalidRequest):
            raise known
        return known

    def _hashes(self, keys: RequestKeys, tokens) -> list[bytes]:
        return keys.hashes(list(tokens), self.layout.block_size, seed=self.spec.hash_seed)

    # -- admission ------------------------------------------------------------------------

    def matched_tokens(self, request, num_computed: int) -> int | None:
        rid = request.request_id
        if not self.does_load or rid in self._tried:
            return 0
        plan = self._plans.get(rid)
        if plan is None:
            plan = self._plan(request)
            if plan is None:
                return None
            self._plans[rid] = plan
        plan.local = num_computed
        return max(0, plan.tokens - num_computed)

    def _plan(self, request) -> _Plan | None:
        """The request's plan, ``None`` while its lookup is on its way."""
        asking = self._asking.get(request.request_id)
        if asking is not None:
            return self._answered(request.request_id, asking)
        self.counts.add("lookups")
        try:
            keys = self._request_keys(request)
        except InvalidRequest as exc:
            return self._missed(f"unkeyed_{unkeyed_field(exc)}")
        hashes = self._hashes(keys, keys.tokens)[:(len(keys.tokens) - 1) // self.layout.block_size]
        try:
            handoff = handoff_from_params(getattr(request, "kv_transfer_params", None))
        except StatetierError as exc:
            log.warning("statetier: request %s: %s", request.request_id, exc)
            return self._missed("handoff")
        if handoff is not None:
            differs = other_field(keys.digests, dict(handoff.keys))
            if differs is not None:
                log.warning("statetier: request %s: the handoff is of another %s: refused", request.request_id,
                            differs)
                return self._missed(f"handoff_{differs}")
            plan = self._plan_from_handoff(handoff, hashes)
            if plan is not None:
                return self._counted(plan)
        return self._look_up(request.request_id, hashes)

    def _look_up(self, rid: str, hashes: list[bytes]) -> _Plan | None:
        size = self.layout.block_size
        bounds = [((i + 1) * size, h) for i, h in enumerate(hashes)]
        if not bounds:
            return self._missed("none")
        try:
            future = self.link.submit("lookup", boundaries=bounds, groups=self.layout.layer_groups,
                                      group_shards=self.layout.group_shards(self.tp_size), kv_layout="blocks",
                                      tp_size=self.tp_size, lease=True)
        except _DAEMON_FAILURES as exc:
            return self._missed(reason_of(exc))
        asking = self._asking[rid] = _Asking(future, time.monotonic(), hashes)
        return self._answered(rid, asking)

    def _by_layer(self, asking: _Asking) -> bool:
        """The group lookup found nothing: ask for per-layer objects (same deadline)."""
        size = self.layout.block_size
        bounds = [((i + 1) * size, h) for i, h in enumerate(asking.hashes)]
        try:
            asking.future = self.link.submit("lookup", self.layout.attention_layers, self.layout.ssm_layers, bounds,
                                             kv_layout="blocks", tp_size=self.tp_size, lease=True)
        except _DAEMON_FAILURES:
            return False
        asking.by_layer = True
        return True

    def _answered(self, rid: str, asking: _Asking) -> _Plan | None:
        """The lookup's plan once answered; a miss past the deadline; else ``None``."""
        if not asking.future.done():
            if time.monotonic() - asking.started < self.cfg.deadline:
                return None
            del self._asking[rid]
            self.link.overdue(asking.future)  # suspect until it answers: the next lookups miss at once
            self._release_when_answered(asking.future)
            self.counts.add("deadline_misses.lookup")
            log.warning("statetier: no lookup answer for request %s within %s s: computed here", rid,
                        self.cfg.deadline)
            return self._missed("deadline")
        del self._asking[rid]
        try:
            found = asking.future.result()
        except _DAEMON_FAILURES as exc:  # an unreachable daemon is a miss, never an engine failure
            log.warning("statetier: no external state for request %s: %s", rid, exc)
            self.link.failed(exc)
            return self._missed(reason_of(exc))
        if found.tokens == 0:
            self._release(found.lease_ids)
            if not asking.by_layer and self._by_layer(asking):
                self._asking[rid] = asking
                return self._answered(rid, asking)
            return self._missed("none")
        tokens, refs = self._unstable_tail_dropped(found.tokens, list(found.refs))
        return self._counted(_Plan(tokens, [self._expected(ref, asking.hashes) for ref in refs], found.lease_ids))

    def _unstable_tail_dropped(self, tokens: int, refs: list[StateRef]) -> tuple[int, list[StateRef]]:
        """With EAGLE, a hit one block short (vLLM drops the drafter's last block of its own hits)."""
        if not self.drops_last_block:
            return tokens, refs
        tokens -= self.layout.block_size
        return tokens, [ref for ref in refs if ref.key.token_end <= tokens]

    def _release_when_answered(self, future: concurrent.futures.Future) -> None:
        """A lookup no one waits for any more: its leases go back when it answers."""
        future.add_done_callback(
            lambda f: None if f.cancelled() or f.exception() is not None else self._release(f.result().lease_ids))

    def _missed(self, reason: str) -> _Plan:
        self.counts.add(f"misses.{reason}")
        return _Plan()

    def _counted(self, plan: _Plan) -> _Plan:
        if plan.tokens:
            self.counts.add("hits")
            self.counts.add("hit_tokens", plan.tokens)
        else:
            self.counts.add("misses.none")
        return plan

    def _plan_from_handoff(self, handoff: Handoff, hashes: list[bytes]) -> _Plan | None:
        """The largest boundary the handed refs cover for every layer and shard; ``None``: look
        the request up instead (the refs cover less than the producer saved).

        The refs' own prefix hashes are not compared here: each load states this request's hash
        (extra keys folded in), so a ref of another prefix is refused by the daemon, loudly.
        """
        size = self.layout.block_size
        if handoff.block_size != size:
            log.warning("statetier: handoff in blocks of %d tokens, this engine uses %d", handoff.block_size, size)
            return _Plan()
        if not handoff.refs or handoff.saved > handoff.tokens:  # its saves were answered after it finished
            self.counts.add("handoffs.looked_up")
            return None
        have = {span_of(r.key): r for r in handoff.refs}
        blocks, refs = self.spans.largest(have, min(handoff.tokens // size, len(hashes)), by_layer=True)
        tokens, refs = self._unstable_tail_dropped(blocks * size, refs)
        return _Plan(tokens, [self._expected(ref, hashes) for ref in refs], source="p2p")

    def _expected(self, found: StateRef, hashes: list[bytes]) -> StateRef:
        """What loading ``found`` must find: this engine's namespace and this prompt's hash."""
        k = found.key
        own = StateKey(self.namespace, k.kind, k.layer, hashes[k.token_end // self.layout.block_size - 1],
                       k.token_start, k.token_end, k.shard, k.group_layers)
        return StateRef(own, found.request_id, found.step, found.state_id, found.version)

    def after_alloc(self, request, block_ids: Sequence[Sequence[int]], num_external: int) -> None:
        rid = request.request_id
        if self.does_save and self.producer.tracked_request(rid) is None:
            self._track(request)
        plan = self._plans.pop(rid, None)
        if num_external <= 0 or plan is None or plan.tokens == 0:
            if plan is not None:
                self._release(plan.leases)
            return
        self._tried.add(rid)
        self._leases[rid] = plan.leases
        self._sources[rid] = plan.source
        self._pending.append(self._load_job(rid, plan, block_ids, num_external))

    def _track(self, request) -> None:
        try:
            keys = self._request_keys(request)
        except InvalidRequest as exc:
            self.counts.add(f"saves_unkeyed.{unkeyed_field(exc)}")
            return
        self.producer.track(request, keys)

    def _load_job(self, rid: str, plan: _Plan, block_ids: Sequence[Sequence[int]], num_external: int) -> LoadJob:
        if plan.local + num_external != plan.tokens:
            # vLLM trimmed the hit: the Mamba state would not match the tokens it skips
            problem = f"vLLM skips {plan.local} + {num_external} tokens; the state is at {plan.tokens}"
            skipped = -(-(plan.local + num_external) // self.layout.block_size)
            blocks = {b for g in self.layout.attention_groups for b in block_ids[g.index][:skipped]}
            return LoadJob(rid, plan.tokens, (), tuple(sorted(blocks)), problem)
        first_block = plan.local // self.layout.block_size  # below: the local prefix-cache hit
        items, written = [], set()
        for ref in plan.refs:
            try:
                group = self.layout.group_of_key(ref.key)
            except InvalidRequest as exc:  # a handoff of another engine's groups: refused, recomputed
                return LoadJob(rid, plan.tokens, (), (), str(exc))
            if ref.key.kind is Kind.SSM:
                block = group.state_block(block_ids[group.index], plan.tokens, self.layout.block_size)
                items.append(LoadItem(group.index, ref, block))
                continue
            block = ref.key.token_start // self.layout.block_size
            if block >= first_block:
                items.append(LoadItem(group.index, ref, block_ids[group.index][block]))
                written.add(block_ids[group.index][block])
        return LoadJob(rid, plan.tokens, tuple(items), tuple(sorted(written)))

    def hit_source(self, request_id: str) -> str:
        """Where the request's hit comes from, as vLLM's ``CacheHitSource`` names it: ``p2p`` (a
        producer's handoff) or ``host`` (the sidecar daemon, whose first tier is host memory)."""
        return self._sources.get(request_id, "host")

    # -- every step -----------------------------------------------------------------------

    def saving_request(self, request_id: str):
        """The request whose prompt this producer saves, or ``None``."""
        return self.producer.tracked_request(request_id)

    def build_meta(self, steps: Sequence[ScheduledStep], preempted: Sequence[str] = (),
                   boundary_states: Mapping[str, Sequence[tuple[int, int, int]]] | None = None) -> StepMeta:
        """``boundary_states``: vLLM's align-mode ``boundary_state_offloads``, ``{request id:
        [(group, block id, boundary tokens)]}``: the exact blocks holding a Mamba state at a
        block end, saved from those blocks (in this step, before vLLM reuses them)."""
        loads, self._pending = tuple(self._pending), []
        saves = self.producer.saves(steps, boundary_states)
        if self.events is not None:
            for job in saves:
                request = self.producer.tracked_request(job.request_id)
                self.events.remember(request, [item.key for item in job.items], self.layout.block_size)
        flushed = tuple(rid for rid in preempted if self.producer.has_saved(rid))
        return StepMeta(loads, tuple(saves), flushed)

    def refs_saved(self, by_request) -> None:
        """The refs the workers' saves were answered with, by request (worker metadata)."""
        self.producer.refs_saved(by_request)

    def loads_finished(self, request_ids) -> None:
        for rid in request_ids:
            self._release(self._leases.pop(rid, []))

    def request_finished(self, request) -> tuple[bool, dict | None]:
        started = time.perf_counter()
        try:
            return self._finished(request)
        finally:
            self.counts.add("calls.request_finished")
            self.counts.add("scheduler_seconds.request_finished", time.perf_counter() - started)

    def _finished(self, request) -> tuple[bool, dict | None]:
        rid = request.request_id
        asking = self._asking.pop(rid, None)
        if asking is not None:
            self._release_when_answered(asking.future)
        plan = self._plans.pop(rid, None)
        if plan is not None:
            self._release(plan.leases)
        self._release(self._leases.pop(rid, []))
        self._tried.discard(rid)
        self._keys.pop(rid, None)
        self._sources.pop(rid, None)
        return self.producer.finish(rid, hand_off=self.hands_off)

    # -- the daemon -----------------------------------------------------------------------

    def _release(self, lease_ids) -> None:
        if lease_ids:
            self.link.release(lease_ids)

    def reset_cache(self) -> bool:
        """Every object of this namespace removed from the daemon (vLLM's ``reset_prefix_cache``
        with the connector's cache); False when the daemon could not do it."""
        try:
            purged = self.link.submit("purge").result(timeout=self.cfg.timeout)
        except _DAEMON_FAILURES as exc:
            log.warning("statetier: reset_cache failed: %s", exc)
            return False
        log.info("statetier: reset_cache removed %s objects (%s bytes)", purged.get("objects"), purged.get("bytes"))
        return True

    def events_topic(self, template: str) -> str:
        """The topic of this namespace's KV events (the daemon's ``events.topic`` as ``template``);
        connects and waits (once, at start)."""
        return self.link.connected().events_topic(template)

    def take_events(self) -> list:
        """The daemon's events of this namespace's saved blocks since the last call (``events.py``)."""
        return self.events.take() if self.events is not None else []

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.link.close()
