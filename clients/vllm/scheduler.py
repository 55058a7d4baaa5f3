"""The scheduler side of the vLLM connector, as a plain class (no vLLM import).

``SchedulerSide(cfg, layout, spec, *, tp_size, loads, saves, client=None)``; the vLLM adapter
calls, in vLLM's order:

- ``matched_tokens(request, num_computed)`` — how many tokens beyond ``num_computed`` the
  engine may skip. From a handoff in ``request.kv_transfer_params`` (the producer's refs),
  else from the daemon's joint-hit ``lookup`` over every attention and Mamba layer at the
  attention block ends and every TP shard (``tp_size``: the boundary all shards hold).
  Never the whole prompt (vLLM computes at least one token), one answer per request
  (cached, so repeated calls agree), and 0 once a load of this request was tried.
- ``after_alloc(request, block_ids, num_external)`` — with the block ids per cache group, a
  ``LoadJob``: one expected ref per object into its block (attention) or slot (Mamba).
- ``saving_request(request_id)`` — the tracked request of a producer (its steps feed ``build_meta``).
- ``build_meta(steps)`` → ``StepMeta``: the pending loads, and the saves of this step for
  producers: every attention block of the prompt the step completes, and every Mamba
  layer's state when the step ends on a block end of the prompt (``tokens_absorbed`` = that end).
- ``loads_finished(request_ids)`` — the workers are done with these loads: leases released.
- ``request_finished(request)`` → handoff ``kv_transfer_params`` (producers) or ``None``.
- ``take_events()`` → the daemon's KV events of the blocks this side saved, named by vLLM's
  block hashes (``events``: a ``events.ConnectorEvents`` when ``events_endpoint`` is set; the
  saves of each step are remembered for it); ``events_topic(template)`` → the topic of this
  side's namespace in them, as the daemon owns it for the tenant (connects).
- ``close()``.

``request``: anything with ``request_id``, ``prompt_token_ids``, ``kv_transfer_params``
(vLLM's ``Request``, or a plain object in tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from statetier.protocol.errors import StatetierError
from statetier.protocol.identity import Kind, NamespaceSpec, StateKey, StateRef, prefix_hashes

from .jobs import LoadItem, LoadJob, SaveItem, SaveJob, StepMeta, handoff_from_params, handoff_params
from .layout import ConnectorConfig, EngineLayout

log = logging.getLogger("statetier.vllm")


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
class _Tracked:
    request: Any
    hashes: list[bytes]            # the prompt's chained hash at each full block end
    next_block: int | None = None  # first prompt block not yet saved
    saved: bool = False


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, layout: EngineLayout, spec: NamespaceSpec, *, tp_size: int = 1,
                 loads: bool = True, saves: bool = True, client=None) -> None:
        self.cfg, self.layout, self.spec = cfg, layout, spec
        self.namespace = spec.namespace()
        self.tp_size = tp_size
        self.does_load, self.does_save = loads, saves
        self._client = client
        self._plans: dict[str, _Plan] = {}
        self._tried: set[str] = set()
        self._leases: dict[str, list[int]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[LoadJob] = []
        self.events = None  # the connector sets an ``events.ConnectorEvents`` (``connector.connector_events``)

    # -- admission ------------------------------------------------------------------------

    def matched_tokens(self, request, num_computed: int) -> int:
        rid = request.request_id
        if not self.does_load or rid in self._tried:
            return 0
        plan = self._plans.get(rid)
        if plan is None:
            plan = self._plans[rid] = self._plan(request)
        plan.local = num_computed
        return max(0, plan.tokens - num_computed)

    def _plan(self, request) -> _Plan:
        if request.prompt_token_ids is None:  # prompt embeddings: no token ids to key state by
            return _Plan()
        tokens = list(request.prompt_token_ids)
        hashes = self._hashes(tokens)
        limit = (len(tokens) - 1) // self.layout.block_size  # whole blocks short of the last token
        try:
            handoff = handoff_from_params(getattr(request, "kv_transfer_params", None))
            if handoff is not None:
                return self._plan_from_handoff(handoff, hashes[:limit])
            return self._plan_from_lookup(hashes[:limit])
        except (StatetierError, OSError) as exc:  # an unreachable daemon is a miss, never an engine failure
            log.warning("statetier: no external state for request %s: %s", request.request_id, exc)
            return _Plan()

    def _plan_from_lookup(self, hashes: list[bytes]) -> _Plan:
        """The daemon's joint hit over every layer and every TP shard, leased."""
        size = self.layout.block_size
        bounds = [((i + 1) * size, h) for i, h in enumerate(hashes)]
        if not bounds:
            return _Plan()
        found = self._connected().lookup(self.layout.attention_layers, self.layout.ssm_layers, bounds,
                                         kv_layout="blocks", tp_size=self.tp_size, lease=True)
        if found.tokens == 0:
            self._release(found.lease_ids)
            return _Plan()
        return _Plan(found.tokens, [self._expected(ref, hashes) for ref in found.refs], found.lease_ids)

    def _plan_from_handoff(self, handoff, hashes: list[bytes]) -> _Plan:
        """The largest boundary the handed refs cover for every layer and shard.

        The refs' own prefix hashes are not compared here: each load states this request's
        hash, so a ref of another prompt is refused by the daemon, loudly.
        """
        size = self.layout.block_size
        if handoff.block_size != size:
            log.warning("statetier: handoff in blocks of %d tokens, this engine uses %d", handoff.block_size, size)
            return _Plan()
        have = {(r.key.kind, r.key.layer, r.key.shard, r.key.token_start, r.key.token_end): r for r in handoff.refs}
        for blocks in range(min(handoff.tokens // size, len(hashes)), 0, -1):
            wanted = self._wanted_spans(blocks)
            if all(span in have for span in wanted):
                return _Plan(blocks * size, [self._expected(have[span], hashes) for span in wanted])
        return _Plan()

    def _wanted_spans(self, blocks: int) -> list[tuple]:
        size, end = self.layout.block_size, blocks * self.layout.block_size
        spans = []
        for shard in range(self.tp_size):
            spans += [(Kind.KV, lid, shard, j * size, (j + 1) * size)
                      for lid in self.layout.attention_layers for j in range(blocks)]
            spans += [(Kind.SSM, lid, shard, 0, end) for lid in self.layout.ssm_layers]
        return spans

    def _expected(self, found: StateRef, hashes: list[bytes]) -> StateRef:
        """What loading ``found`` must find: this engine's namespace and this prompt's hash."""
        k = found.key
        own = StateKey(self.namespace, k.kind, k.layer, hashes[k.token_end // self.layout.block_size - 1],
                       k.token_start, k.token_end, k.shard)
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
            group, name = self.layout.group_of(ref.key.kind, ref.key.layer)
            if ref.key.kind is Kind.SSM:
                items.append(LoadItem(name, ref, block_ids[group.index][0]))
                continue
            block = ref.key.token_start // self.layout.block_size
            if block >= first_block:
                items.append(LoadItem(name, ref, block_ids[group.index][block]))
                written.add(block_ids[group.index][block])
        self._pending.append(LoadJob(rid, plan.tokens, tuple(items), tuple(sorted(written))))

    # -- every step -----------------------------------------------------------------------

    def saving_request(self, request_id: str):
        """The request whose prompt this producer saves, or ``None``."""
        tracked = self._tracked.get(request_id)
        return tracked.request if tracked is not None else None

    def build_meta(self, steps: Sequence[ScheduledStep]) -> StepMeta:
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
        return StepMeta(loads, tuple(saves))

    def _saves_of(self, tracked: _Tracked, step: ScheduledStep) -> SaveJob | None:
        size = self.layout.block_size
        prompt_len = len(tracked.request.prompt_token_ids)
        absorbed = step.num_computed + step.num_scheduled
        if tracked.next_block is None:
            tracked.next_block = step.num_computed // size  # blocks below came from a load or the prefix cache
        last = min(absorbed, prompt_len) // size
        items = []
        for block in range(tracked.next_block, last):
            for group in self.layout.attention_groups:
                for name, lid in group.layers:
                    key = StateKey(self.namespace, Kind.KV, lid, tracked.hashes[block], block * size,
                                   (block + 1) * size)
                    items.append(SaveItem(name, key, step.block_ids[group.index][block]))
        tracked.next_block = max(tracked.next_block, last)
        if absorbed % size == 0 and 0 < absorbed <= prompt_len and step.num_scheduled > 0:
            for group in self.layout.mamba_groups:
                for name, lid in group.layers:
                    key = StateKey(self.namespace, Kind.SSM, lid, tracked.hashes[absorbed // size - 1], 0, absorbed)
                    items.append(SaveItem(name, key, step.block_ids[group.index][0]))
        if not items:
            return None
        tracked.saved = True
        return SaveJob(tracked.request.request_id, absorbed, tuple(items))

    def loads_finished(self, request_ids) -> None:
        for rid in request_ids:
            self._release(self._leases.pop(rid, []))

    def request_finished(self, request) -> dict | None:
        rid = request.request_id
        plan = self._plans.pop(rid, None)
        if plan is not None:
            self._release(plan.leases)
        self._release(self._leases.pop(rid, []))
        self._tried.discard(rid)
        tracked = self._tracked.pop(rid, None)
        if tracked is None or not tracked.saved:
            return None
        return self._handoff(tracked)

    def _handoff(self, tracked: _Tracked) -> dict | None:
        """The refs of the joint hit this request's saves made (all shards), for a consumer of
        the same prompt: at most the block end a consumer can use (short of the last token)."""
        size = self.layout.block_size
        usable = (len(tracked.request.prompt_token_ids) - 1) // size
        bounds = [((i + 1) * size, h) for i, h in enumerate(tracked.hashes[:usable])]
        if not bounds:
            return None
        try:
            found = self._connected().lookup(self.layout.attention_layers, self.layout.ssm_layers, bounds,
                                             kv_layout="blocks", tp_size=self.tp_size, lease=False)
        except (StatetierError, OSError) as exc:
            log.warning("statetier: no handoff for request %s: %s", tracked.request.request_id, exc)
            return None
        if not found.tokens:
            return None
        return handoff_params(found.tokens, size, found.refs)

    # -- the daemon -----------------------------------------------------------------------

    def _hashes(self, tokens) -> list[bytes]:
        return prefix_hashes(list(tokens), self.layout.block_size, seed=self.spec.hash_seed)

    def _connected(self):
        if self._client is None:
            from ..sync_client import Client

            self._client = Client(self.cfg.url, namespace=self.spec, tenant=self.cfg.tenant, token=self.cfg.token,
                                  use_shm=False, timeout=self.cfg.timeout).connect()
        return self._client

    def _release(self, lease_ids) -> None:
        if lease_ids and self._client is not None:
            try:
                self._client.release(list(lease_ids))
            except StatetierError as exc:  # the daemon drops them with the connection anyway
                log.warning("statetier: releasing leases failed: %s", exc)

    def events_topic(self, template: str) -> str:
        """The topic of this namespace's KV events (the daemon's ``events.topic`` as ``template``)."""
        return self._connected().events_topic(template)

    def take_events(self) -> list:
        """The daemon's events of this namespace's saved blocks since the last call (``events.py``)."""
        return self.events.take() if self.events is not None else []

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        if self._client is not None:
            self._client.close()
