"""The scheduler side of the vLLM connector, as a plain class (no vLLM import).

``SchedulerSide(cfg, layout, spec, *, tp_size, loads, saves, client=None)``; the vLLM adapter
calls, in vLLM's order:

- ``matched_tokens(request, num_computed)`` — how many tokens beyond ``num_computed`` the
  engine may skip, or ``None`` while the daemon's answer is on its way (vLLM asks again
  next step). From a handoff in ``request.kv_transfer_params`` (the producer's refs: no
  daemon call), else from the daemon's joint-hit ``lookup`` over every KV cache group's
  group objects (``groups=``) at the attention block ends and every TP shard (``tp_size``:
  the boundary all shards hold); when that finds nothing, over per-layer objects (what
  producers saved before group objects). Started on the first call and never waited on:
  not answered within ``cfg.deadline`` it is a miss (counted). Never the whole prompt (vLLM computes at least
  one token), one answer per request (cached, so repeated calls agree), and 0 once a load
  of this request was tried.
- ``after_alloc(request, block_ids, num_external)`` — with the block ids per cache group, a
  ``LoadJob``: one expected ref per object into its block (attention) or slot (Mamba).
- ``saving_request(request_id)`` — the tracked request of a producer (its steps feed ``build_meta``).
- ``build_meta(steps, preempted=())`` → ``StepMeta``: the pending loads, the saves of this
  step for producers (one group object per attention group for every block of the prompt
  the step completes, and one per Mamba group when the step ends on a block end of the
  prompt: ``tokens_absorbed`` = that end; with ``saves_decode``, of the decoded tokens too,
  for a next turn), and the preempted requests whose saves the workers flush.
- ``loads_finished(request_ids)`` — the workers are done with these loads: leases released.
- ``reset_cache()`` — this namespace's objects purged from the daemon.
- ``request_finished(request)`` → ``(delay_free, kv_transfer_params)``: ``delay_free`` when
  saves of the request were scheduled (the workers report it in ``finished_sending`` once
  they are done, and vLLM keeps its blocks until then); the handoff (producers) or ``None``,
  from a lookup waited on for at most ``cfg.deadline``.
- ``counts`` — ``stats.ConnectorCounts``: lookups, hits, misses by reason, deadline misses.
- ``take_events()`` → the daemon's KV events of the blocks this side saved, named by vLLM's
  block hashes (``events``: a ``events.ConnectorEvents`` when ``events_endpoint`` is set; the
  saves of each step are remembered for it); ``events_topic(template)`` → the topic of this
  side's namespace in them, as the daemon owns it for the tenant (connects).
- ``close()``.

``request``: anything with ``request_id``, ``prompt_token_ids``, ``kv_transfer_params``
(vLLM's ``Request``, or a plain object in tests).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from statetier.protocol.errors import ClientClosedError, InvalidRequest, StatetierError
from statetier.protocol.identity import Kind, NamespaceSpec, StateKey, StateRef, prefix_hashes

from .jobs import LoadItem, LoadJob, SaveItem, SaveJob, StepMeta, handoff_from_params, handoff_params
from .layout import ConnectorConfig, EngineLayout
from .link import DaemonLink
from .stats import ConnectorCounts, reason_of

log = logging.getLogger("statetier.vllm")

#: what a daemon call may end with that is the daemon's (or its connection's) doing: a miss
_DAEMON_FAILURES = (StatetierError, OSError, ClientClosedError, concurrent.futures.CancelledError)


@dataclass(frozen=True)
class ScheduledStep:
    """One request in one engine step: ``num_computed`` before it, ``num_scheduled`` in it."""

    request: Any
    num_computed: int
    num_scheduled: int
    block_ids: Sequence[Sequence[int]]


@dataclass
class _Plan:
    tokens: int = 0
    refs: list[StateRef] = field(default_factory=list)   # expected refs, every shard
    leases: list[int] = field(default_factory=list)
    local: int = 0                                       # num_computed when asked


@dataclass
class _Asking:
    """A lookup on its way: the daemon's answer, when it was asked, the prompt's hashes."""

    future: concurrent.futures.Future
    started: float
    hashes: list[bytes]
    by_layer: bool = False  # the second lookup: per-layer objects


@dataclass
class _Tracked:
    request: Any
    hashes: list[bytes]            # the chained hash at each full block end (prompt, then decoded tokens)
    next_block: int | None = None  # first block not yet saved
    saved: bool = False


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, layout: EngineLayout, spec: NamespaceSpec, *, tp_size: int = 1,
                 loads: bool = True, saves: bool = True, saves_decode: bool = False) -> None:
        self.cfg, self.layout, self.spec = cfg, layout, spec
        self.namespace = spec.namespace()
        self.tp_size = tp_size
        self.does_load, self.does_save = loads, saves
        self.saves_decode = saves_decode
        self.link = DaemonLink(cfg, spec, use_shm=False)
        self.counts = ConnectorCounts()
        self._asking: dict[str, _Asking] = {}
        self._plans: dict[str, _Plan] = {}
        self._tried: set[str] = set()
        self._leases: dict[str, list[int]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[LoadJob] = []
        self.events = None  # the connector sets an ``events.ConnectorEvents`` (``connector.connector_events``)

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
        if request.prompt_token_ids is None:  # prompt embeddings: no token ids to key state by
            return _Plan()
        tokens = list(request.prompt_token_ids)
        hashes = self._hashes(tokens)[:(len(tokens) - 1) // self.layout.block_size]  # short of the last token
        self.counts.add("lookups")
        try:
            handoff = handoff_from_params(getattr(request, "kv_transfer_params", None))
        except StatetierError as exc:
            log.warning("statetier: request %s: %s", request.request_id, exc)
            return self._missed("handoff")
        if handoff is not None:
            return self._counted(self._plan_from_handoff(handoff, hashes))
        size = self.layout.block_size
        bounds = [((i + 1) * size, h) for i, h in enumerate(hashes)]
        if not bounds:
            return self._missed("none")
        try:
            future = self.link.submit("lookup", boundaries=bounds, groups=self.layout.layer_groups,
                                      kv_layout="blocks", tp_size=self.tp_size, lease=True)
        except _DAEMON_FAILURES as exc:
            return self._missed(reason_of(exc))
        asking = self._asking[request.request_id] = _Asking(future, time.monotonic(), hashes)
        return self._answered(request.request_id, asking)

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
        return self._counted(_Plan(found.tokens, [self._expected(ref, asking.hashes) for ref in found.refs],
                                   found.lease_ids))

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

    def _plan_from_handoff(self, handoff, hashes: list[bytes]) -> _Plan:
        """The largest boundary the handed refs cover for every layer and shard.

        The refs' own prefix hashes are not compared here: each load states this request's
        hash, so a ref of another prompt is refused by the daemon, loudly.
        """
        size = self.layout.block_size
        if handoff.block_size != size:
            log.warning("statetier: handoff in blocks of %d tokens, this engine uses %d", handoff.block_size, size)
            return _Plan()
        have = {_span(r.key): r for r in handoff.refs}
        for blocks in range(min(handoff.tokens // size, len(hashes)), 0, -1):
            for wanted in (self._wanted_groups(blocks), self._wanted_layers(blocks)):
                if all(span in have for span in wanted):
                    return _Plan(blocks * size, [self._expected(have[span], hashes) for span in wanted])
        return _Plan()

    def _wanted_groups(self, blocks: int) -> list[tuple]:
        """The group objects of every cache group a restore at ``blocks`` blocks needs."""
        size, end = self.layout.block_size, blocks * self.layout.block_size
        spans = []
        for shard in range(self.tp_size):
            for group in self.layout.groups:
                layers = group.layer_group.layers
                if group.kind is Kind.KV:
                    spans += [(Kind.KV, group.index, layers, shard, j * size, (j + 1) * size) for j in range(blocks)]
                else:
                    spans.append((Kind.SSM, group.index, layers, shard, 0, end))
        return spans

    def _wanted_layers(self, blocks: int) -> list[tuple]:
        """The per-layer objects of every layer (what producers saved before group objects)."""
        size, end = self.layout.block_size, blocks * self.layout.block_size
        spans = []
        for shard in range(self.tp_size):
            spans += [(Kind.KV, lid, (), shard, j * size, (j + 1) * size)
                      for lid in self.layout.attention_layers for j in range(blocks)]
            spans += [(Kind.SSM, lid, (), shard, 0, end) for lid in self.layout.ssm_layers]
        return spans

    def _expected(self, found: StateRef, hashes: list[bytes]) -> StateRef:
        """What loading ``found`` must find: this engine's namespace and this prompt's hash."""
        k = found.key
        own = StateKey(self.namespace, k.kind, k.layer, hashes[k.token_end // self.layout.block_size - 1],
                       k.token_start, k.token_end, k.shard, k.group_layers)
        return StateRef(own, found.request_id, found.step, found.state_id, found.version)

    def after_alloc(self, request, block_ids: Sequence[Sequence[int]], num_external: int) -> None:
        rid = request.request_id
        if self.does_save:
            self._tracked[rid] = _Tracked(request, self._hashes(request.prompt_token_ids))
        plan = self._plans.pop(rid, None)
        if num_external <= 0 or plan is None or plan.tokens == 0:
            if plan is not None:
                self._release(plan.leases)
            return
        self._tried.add(rid)
        self._leases[rid] = plan.leases
        if plan.local + num_external != plan.tokens:
            # vLLM trimmed the hit: the Mamba state would not match the tokens it skips
            problem = f"vLLM skips {plan.local} + {num_external} tokens; the state is at {plan.tokens}"
            skipped = -(-(plan.local + num_external) // self.layout.block_size)
            blocks = {b for g in self.layout.attention_groups for b in block_ids[g.index][:skipped]}
            self._pending.append(LoadJob(rid, plan.tokens, (), tuple(sorted(blocks)), problem))
            return
        first_block = plan.local // self.layout.block_size  # below: the local prefix-cache hit
        items, written = [], set()
        for ref in plan.refs:
            try:
                group = self.layout.group_of_key(ref.key)
            except InvalidRequest as exc:  # a handoff of another engine's groups: refused, recomputed
                self._pending.append(LoadJob(rid, plan.tokens, (), (), str(exc)))
                return
            if ref.key.kind is Kind.SSM:
                items.append(LoadItem(group.index, ref, block_ids[group.index][0]))
                continue
            block = ref.key.token_start // self.layout.block_size
            if block >= first_block:
                items.append(LoadItem(group.index, ref, block_ids[group.index][block]))
                written.add(block_ids[group.index][block])
        self._pending.append(LoadJob(rid, plan.tokens, tuple(items), tuple(sorted(written))))

    # -- every step -----------------------------------------------------------------------

    def saving_request(self, request_id: str):
        """The request whose prompt this producer saves, or ``None``."""
        tracked = self._tracked.get(request_id)
        return tracked.request if tracked is not None else None

    def build_meta(self, steps: Sequence[ScheduledStep], preempted: Sequence[str] = ()) -> StepMeta:
        loads, self._pending = tuple(self._pending), []
        saves = []
        for step in steps:
            tracked = self._tracked.get(step.request.request_id)
            if tracked is not None:
                job = self._saves_of(tracked, step)
                if job is not None:
                    saves.append(job)
                    if self.events is not None:
                        self.events.remember(step.request, [item.key for item in job.items], self.layout.block_size)
        flushed = tuple(rid for rid in preempted if rid in self._tracked and self._tracked[rid].saved)
        return StepMeta(loads, tuple(saves), flushed)

    def _saves_of(self, tracked: _Tracked, step: ScheduledStep) -> SaveJob | None:
        size = self.layout.block_size
        known = self._saved_tokens(tracked.request)
        absorbed = step.num_computed + step.num_scheduled
        if tracked.next_block is None:
            tracked.next_block = step.num_computed // size  # blocks below came from a load or the prefix cache
        last = min(absorbed, len(known)) // size
        if last > len(tracked.hashes):  # decoded tokens completed a block
            tracked.hashes = self._hashes(known[:last * size])
        items = []
        for block in range(tracked.next_block, last):
            for group in self.layout.attention_groups:
                key = group.layer_group.key(self.namespace, tracked.hashes[block], block * size, (block + 1) * size)
                items.append(SaveItem(group.index, key, step.block_ids[group.index][block]))
        tracked.next_block = max(tracked.next_block, last)
        if absorbed % size == 0 and 0 < absorbed <= len(known) and step.num_scheduled > 0:
            for group in self.layout.mamba_groups:
                key = group.layer_group.key(self.namespace, tracked.hashes[absorbed // size - 1], 0, absorbed)
                items.append(SaveItem(group.index, key, step.block_ids[group.index][0]))
        if not items:
            return None
        tracked.saved = True
        return SaveJob(tracked.request.request_id, absorbed, tuple(items))

    def _saved_tokens(self, request) -> Sequence[int]:
        """The tokens whose blocks this producer saves: the prompt, and with ``saves_decode`` the
        decoded ones too (vLLM's ``all_token_ids``: a next turn's prompt starts with them)."""
        if self.saves_decode:
            return getattr(request, "all_token_ids", None) or request.prompt_token_ids
        return request.prompt_token_ids

    def loads_finished(self, request_ids) -> None:
        for rid in request_ids:
            self._release(self._leases.pop(rid, []))

    def request_finished(self, request) -> tuple[bool, dict | None]:
        rid = request.request_id
        asking = self._asking.pop(rid, None)
        if asking is not None:
            self._release_when_answered(asking.future)
        plan = self._plans.pop(rid, None)
        if plan is not None:
            self._release(plan.leases)
        self._release(self._leases.pop(rid, []))
        self._tried.discard(rid)
        tracked = self._tracked.pop(rid, None)
        if tracked is None or not tracked.saved:
            return False, None
        return True, self._handoff(tracked)

    def _handoff(self, tracked: _Tracked) -> dict | None:
        """The refs of the joint hit this request's saves made (all shards), for a consumer of
        the same prompt: at most the block end a consumer can use (short of the last token).
        The lookup is waited on for at most the deadline (then: no handoff, counted)."""
        size = self.layout.block_size
        usable = (len(tracked.request.prompt_token_ids) - 1) // size
        bounds = [((i + 1) * size, h) for i, h in enumerate(tracked.hashes[:usable])]
        if not bounds:
            return None
        rid = tracked.request.request_id
        try:
            future = self.link.submit("lookup", boundaries=bounds, groups=self.layout.layer_groups,
                                      kv_layout="blocks", tp_size=self.tp_size, lease=False)
            found = future.result(timeout=self.cfg.deadline)
        except concurrent.futures.TimeoutError:
            log.warning("statetier: no handoff for request %s: no answer within %s s", rid, self.cfg.deadline)
            self.link.overdue(future)
            self.counts.add("deadline_misses.handoff")
            return None
        except _DAEMON_FAILURES as exc:
            log.warning("statetier: no handoff for request %s: %s", rid, exc)
            self.link.failed(exc)
            return None
        if not found.tokens:
            return None
        return handoff_params(found.tokens, size, found.refs)

    # -- the daemon -----------------------------------------------------------------------

    def _hashes(self, tokens) -> list[bytes]:
        return prefix_hashes(list(tokens), self.layout.block_size, seed=self.spec.hash_seed)

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


def _span(key: StateKey) -> tuple:
    """What a handoff's ref stands for: kind, layer or group, its layers, shard, token span."""
    return key.kind, key.layer, tuple(key.group_layers), key.shard, key.token_start, key.token_end
