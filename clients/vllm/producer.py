"""The producer half of the connector's scheduler side: what each step saves, and the handoff.

``Producer(layout, namespace, spans, counts, hashes, *, saves_decode)`` — held by
``SchedulerSide`` (``scheduler.py``), which forwards vLLM's calls; no vLLM, no daemon call:

- ``ScheduledStep(request, num_computed, num_scheduled, block_ids)`` — one request in one step.
- ``track(request, keys)`` — a request this producer saves (its extra keys derived: a request that
  cannot be keyed is never tracked); ``tracked_request(request_id)`` → it, or ``None``.
- ``saves(steps, boundary_states)`` → the ``SaveJob``s of one engine step: one group object per
  attention group for every block of the saved tokens the step completes, and per Mamba group
  its state where the step ends on a block end ("none" mode: the request's slot) or where vLLM
  hands over a boundary state (align mode: ``boundary_state_offloads``, the exact block).
- ``refs_saved(by_request)`` — the refs the workers' saves were answered with (worker metadata).
- ``finish(request_id)`` → ``(delay_free, kv_transfer_params)``: the handoff from those refs
  (``handoff.py``): at most the last block end short of the last token, ``saved`` the boundary
  saved, the request's extra keys named (``keys``); by ref when every ref is in, else by key.
- ``has_saved(request_id)`` — whether saves of it were scheduled (preemption flushes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import Kind, Namespace

from .extra_keys import RequestKeys
from .handoff import SavedRefs, Spans
from .jobs import SaveItem, SaveJob, handoff_params
from .layout import EngineLayout
from .stats import ConnectorCounts


@dataclass(frozen=True)
class ScheduledStep:
    """One request in one engine step: ``num_computed`` before it, ``num_scheduled`` in it."""

    request: Any
    num_computed: int
    num_scheduled: int
    block_ids: Sequence[Sequence[int]]


@dataclass
class Tracked:
    request: Any
    keys: RequestKeys
    hashes: list[bytes]            # the chained hash at each full block end (prompt, then decoded tokens)
    next_block: int | None = None  # first block not yet saved
    saved: bool = False
    state_ends: set[int] = field(default_factory=set)  # boundaries whose Mamba states were scheduled
    refs: SavedRefs = field(default_factory=SavedRefs)


class Producer:
    def __init__(self, layout: EngineLayout, namespace: Namespace, spans: Spans, counts: ConnectorCounts,
                 hashes: Callable[[RequestKeys, Sequence[int]], list[bytes]], *, saves_decode: bool = False) -> None:
        self.layout, self.namespace, self.spans, self.counts = layout, namespace, spans, counts
        self._hashes = hashes
        self.saves_decode = saves_decode
        self.tracked: dict[str, Tracked] = {}

    def track(self, request, keys: RequestKeys) -> None:
        if request.request_id not in self.tracked:
            self.tracked[request.request_id] = Tracked(request, keys, self._hashes(keys, keys.tokens))

    def tracked_request(self, request_id: str):
        tracked = self.tracked.get(request_id)
        return tracked.request if tracked is not None else None

    def has_saved(self, request_id: str) -> bool:
        tracked = self.tracked.get(request_id)
        return tracked is not None and tracked.saved

    def saves(self, steps, boundary_states: Mapping[str, Sequence[tuple[int, int, int]]] | None) -> list[SaveJob]:
        jobs = []
        for step in steps:
            tracked = self.tracked.get(step.request.request_id)
            job = self._saves_of(tracked, step) if tracked is not None else None
            if job is not None:
                jobs.append(job)
        for rid, entries in (boundary_states or {}).items():
            tracked = self.tracked.get(rid)
            job = self._boundary_saves(tracked, entries) if tracked is not None else None
            if job is not None:
                jobs.append(job)
        return jobs

    def _saves_of(self, tracked: Tracked, step: ScheduledStep) -> SaveJob | None:
        size = self.layout.block_size
        known = self._saved_tokens(tracked)
        absorbed = step.num_computed + step.num_scheduled
        if tracked.next_block is None:
            tracked.next_block = step.num_computed // size  # blocks below came from a load or the prefix cache
        last = min(absorbed, len(known)) // size
        if last > len(tracked.hashes):  # decoded tokens completed a block
            tracked.hashes = self._hashes(tracked.keys, known[:last * size])
        items = []
        for block in range(tracked.next_block, last):
            for group in self.layout.attention_groups:
                key = group.layer_group.key(self.namespace, tracked.hashes[block], block * size, (block + 1) * size)
                items.append(SaveItem(group.index, key, step.block_ids[group.index][block]))
        tracked.next_block = max(tracked.next_block, last)
        if absorbed % size == 0 and 0 < absorbed <= len(known) and step.num_scheduled > 0:
            for group in self.layout.mamba_groups:
                if not group.is_aligned:  # align mode: vLLM names each boundary state (boundary_states)
                    key = group.layer_group.key(self.namespace, tracked.hashes[absorbed // size - 1], 0, absorbed)
                    items.append(SaveItem(group.index, key, step.block_ids[group.index][0]))
            tracked.state_ends.add(absorbed)
        if not items:
            return None
        tracked.saved = True
        return SaveJob(tracked.request.request_id, absorbed, tuple(items))

    def _boundary_saves(self, tracked: Tracked, entries: Sequence[tuple[int, int, int]]) -> SaveJob | None:
        """One save of each align-mode Mamba state vLLM handed over at a block end of the saved tokens."""
        size, known = self.layout.block_size, self._saved_tokens(tracked)
        items = []
        for group_index, block_id, boundary in entries:
            try:
                group = self.layout.group(group_index)
            except InvalidRequest:
                continue
            if (group.kind is not Kind.SSM or not group.is_aligned or block_id <= 0 or boundary <= 0
                    or boundary % size or boundary > len(known)):
                continue  # block 0 is vLLM's null block: nothing there
            if boundary // size > len(tracked.hashes):
                tracked.hashes = self._hashes(tracked.keys, known[:boundary])
            key = group.layer_group.key(self.namespace, tracked.hashes[boundary // size - 1], 0, boundary)
            items.append(SaveItem(group.index, key, block_id))
            tracked.state_ends.add(boundary)
        if not items:
            return None
        tracked.saved = True
        return SaveJob(tracked.request.request_id, max(item.key.token_end for item in items), tuple(items))

    def _saved_tokens(self, tracked: Tracked) -> Sequence[int]:
        """The tokens whose blocks this producer saves: the prompt, and with ``saves_decode`` the
        decoded ones too (vLLM's ``all_token_ids``: a next turn's prompt starts with them)."""
        if self.saves_decode:
            return getattr(tracked.request, "all_token_ids", None) or tracked.keys.tokens
        return tracked.keys.tokens

    def refs_saved(self, by_request) -> None:
        """The refs the workers' saves were answered with, by request (worker metadata)."""
        for rid, refs in (by_request or {}).items():
            tracked = self.tracked.get(rid)
            if tracked is not None:
                tracked.refs.add(refs)

    def finish(self, request_id: str, *, hand_off: bool = True) -> tuple[bool, dict | None]:
        tracked = self.tracked.pop(request_id, None)
        if tracked is None or not tracked.saved:
            return False, None
        return True, self._handoff(tracked) if hand_off else None

    def _handoff(self, tracked: Tracked) -> dict | None:
        """The refs of the joint hit this request's saves made (all shards), as its workers
        reported them: at most the block end a consumer can use (short of the last token), and
        the boundary its saves were scheduled to (the consumer looks up what the refs do not cover:
        a save that then failed is a miss there, never a wrong load)."""
        size = self.layout.block_size
        usable = min((len(tracked.keys.tokens) - 1) // size, tracked.next_block or 0)
        saved = next((b for b in range(usable, 0, -1)
                      if not self.layout.mamba_groups or b * size in tracked.state_ends), 0)
        if saved == 0:
            return None
        blocks, refs = self.spans.largest(tracked.refs.refs, saved)
        self.counts.add("handoffs.by_ref" if blocks == saved else "handoffs.by_key")
        return handoff_params((blocks or saved) * size, size, refs, keys=tracked.keys.digests, saved=saved * size)
