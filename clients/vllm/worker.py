"""The worker side of the vLLM connector, as a plain class (torch, no vLLM import).

``WorkerSide(cfg, layout, spec, *, shard)``; the vLLM adapter calls, each step:

- ``register(kv_caches)`` — vLLM's ``{layer name: tensor}``: an attention layer's paged
  buffer with blocks on dim 0 (one page = ``buffer[block]``), a Mamba layer's raw int8 slots
  (``[blocks, 1, 1, bytes]`` or ``[blocks, bytes]``) whose bytes hold the typed states of
  ``CacheGroup.states`` back to back, as vLLM's ``MambaBase.bind_kv_cache`` reads them.
- ``flush(request_ids)`` (``handle_preemptions``) — the saves of preempted requests are
  done, or abandoned (their connection dropped, nothing more sent) past ``cfg.deadline``,
  before vLLM reuses their blocks.
- ``start_loads(jobs)`` (``start_load_kv``) — per request, every object of this TP shard (of a
  replicated Mamba group, ``CacheGroup.is_replicated``: its one object, shard 0) is loaded
  straight into its block or Mamba slot (``load_many(into=…)``: each load states the expected
  ref and the destination's names, dtypes and shapes; the daemon refuses another object's
  identity, position, version or layout before writing, and the payload is verified where it
  lands), started and not waited on: the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS``
  until ``take_results`` reports it.
- ``save(jobs)`` (``wait_for_save``) — Mamba states are copied into staging tensors this side
  owns (vLLM updates the slot in place next step), then one ``put_many`` per request is
  started (this rank's shard of every group; a replicated group's state by rank 0 alone, as
  shard 0), reading the pages from the engine's blocks (kept alive by vLLM until the
  request is reported in ``finished_sending``). Earlier saves of requests with none in this
  step are waited on first, for at most the deadline: a handoff after the prompt's last step
  finds them, and a request still saving overlaps its saves with its compute.
- ``take_results(finished_req_ids)`` → ``Results(finished, failed, sent)``: loads done
  (refused or failed ones also ``failed``: vLLM recomputes the request,
  ``kv_load_failure_policy="recompute"``, and what its load wrote is never used), loads
  past the deadline abandoned (counted, reported failed once their call has ended), and
  finished requests whose saves are all done (``finished_sending``).
  ``take_failed_blocks()`` → the attention blocks of failed loads (vLLM takes block ids
  only from single-group layouts).
- ``take_saved_refs()`` → ``{request id: refs}`` of the saves answered since the last call:
  what the connector's worker metadata carries to the scheduler side (its handoffs).
- ``counts`` — ``stats.ConnectorCounts``: refusals by reason, bytes, seconds and objects per
  direction, deadline misses; ``wait_idle(timeout)`` — every transfer ended (tests, shutdown);
  ``close()``.

With ``cfg.audit_path`` every page saved or loaded is logged as a JSON line with the
BLAKE2b of its bytes (as they lie in the engine's buffer after a load; as they were sent,
for a save), and every refusal with its reason: what the end-to-end test compares.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import torch

from statetier.protocol.errors import InvalidRequest, Unavailable
from statetier.protocol.identity import Kind, NamespaceSpec
from statetier.protocol.messages import ref_to_wire

from ..tensors import byte_view, tensor_bytes, torch_dtype
from ..values import PutItem
from .jobs import LoadItem, LoadJob, SaveJob
from .layout import CacheGroup, ConnectorConfig, EngineLayout
from .link import DaemonLink
from .stats import ConnectorCounts, reason_of

log = logging.getLogger("statetier.vllm")


@dataclass
class Results:
    """One ``take_results``: loads ended (``finished``; refused or failed ones also in
    ``failed``) and finished requests whose saves all ended (``sent``)."""

    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    sent: set[str] = field(default_factory=set)


@dataclass
class _Load:
    job: LoadJob
    items: list[LoadItem]
    future: concurrent.futures.Future
    started: float
    abandoned: bool = False


@dataclass
class _Save:
    job: SaveJob
    puts: list[PutItem]
    future: concurrent.futures.Future
    started: float
    is_counted: bool = False


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, layout: EngineLayout, spec: NamespaceSpec, *, shard: int = 0) -> None:
        self.cfg, self.layout, self.spec, self.shard = cfg, layout, spec, shard
        self.link = DaemonLink(cfg, spec, producer_id=f"vllm-worker-{shard}")
        self.counts = ConnectorCounts()
        self._pages: dict[str, torch.Tensor] = {}          # attention layer → paged buffer
        self._slots: dict[str, tuple[torch.Tensor, CacheGroup]] = {}  # Mamba layer → raw slots
        self._loads: dict[str, _Load] = {}
        self._saves: dict[str, list[_Save]] = {}            # request → its saves not yet reported
        self._finished: set[str] = set()                     # requests vLLM finished, saves pending
        self._results = Results()
        self._failed_blocks: set[int] = set()
        self._saved_refs: dict[str, list] = {}              # request → refs answered, not yet reported

    # -- buffers --------------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        for group in self.layout.groups:
            for name, _ in group.layers:
                if name not in kv_caches:
                    raise KeyError(f"vLLM registered no cache for layer {name!r}")
                buffer = kv_caches[name]
                if group.kind is Kind.KV:
                    self._pages[name] = buffer
                else:
                    raw = buffer.view(buffer.shape[0], -1)  # a view, never a copy: loads write through it
                    if raw.dtype != torch.int8 and raw.dtype != torch.uint8:
                        raise TypeError(f"Mamba layer {name!r}: expected raw int8 slots, got {raw.dtype}")
                    self._slots[name] = (raw, group)

    def page(self, layer_name: str, block_id: int) -> torch.Tensor:
        return self._pages[layer_name][block_id]

    def states(self, layer_name: str, slot: int) -> dict[str, torch.Tensor]:
        """Typed views of one Mamba slot, in the group's state order."""
        raw, group = self._slots[layer_name]
        out, offset = {}, 0
        for spec in group.states:
            dtype = torch_dtype(spec.dtype)
            nbytes = _numel(spec.shape) * dtype.itemsize
            out[spec.name] = raw[slot, offset:offset + nbytes].view(dtype).view(spec.shape)
            offset += nbytes
        return out

    def _views(self, layer_name: str, kind: Kind, block_id: int) -> dict[str, torch.Tensor]:
        return {"kv": self.page(layer_name, block_id)} if kind is Kind.KV else self.states(layer_name, block_id)

    def _layers(self, group_index: int, key) -> list[tuple[str, int]]:
        """``(layer name, layer id)`` of the layers an object covers: every layer of a group
        object, in the key's order, or the one layer of a per-layer object."""
        group = self.layout.group(group_index)
        layer_ids = key.group_layers or (key.layer,)
        return [(group.name_of(lid), lid) for lid in layer_ids]

    def _destination(self, group_index: int, key, block_id: int):
        """A group object's regions ``{layer: {name: view}}``, a per-layer object's ``{name: view}``."""
        layers = self._layers(group_index, key)
        if not key.group_layers:
            return self._views(layers[0][0], key.kind, block_id)
        return {lid: self._views(name, key.kind, block_id) for name, lid in layers}

    def _by_layer(self, group_index: int, key, regions) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """``(layer name, {name: tensor})`` of an object's regions (as ``_destination`` gives them)."""
        if not key.group_layers:
            return [(self._layers(group_index, key)[0][0], regions)]
        return [(name, regions[lid]) for name, lid in self._layers(group_index, key)]

    # -- loads ----------------------------------------------------------------------------

    def start_loads(self, jobs: Sequence[LoadJob]) -> None:
        for job in jobs:
            try:
                items = [item for item in job.items
                         if item.ref.key.shard == self.layout.group(item.group).shard_of(self.shard)]
                if job.problem:
                    raise InvalidRequest(job.problem)
                future = self.link.submit("load_many", [item.ref for item in items],
                                          into=[self._destination(i.group, i.ref.key, i.block_id) for i in items])
            except Exception as exc:  # noqa: BLE001 - any failure means: recompute, never run on it
                self._refused(job, exc, reason_of(exc))
                continue
            self._loads[job.request_id] = _Load(job, items, future, time.monotonic())

    def _harvest_loads(self) -> None:
        now, overdue = time.monotonic(), False
        for rid, load in list(self._loads.items()):
            if load.future.done():
                del self._loads[rid]
                exc = load.future.exception() if not load.future.cancelled() else Unavailable("load cancelled")
                if exc is not None:  # an abandoned load that landed before its connection went is whole
                    self.link.failed(exc)
                    self._refused(load.job, exc, "deadline" if load.abandoned else reason_of(exc))
                    continue
                self._results.finished.add(rid)
                landed = [(item.ref.key, self._by_layer(item.group, item.ref.key,
                                                         self._destination(item.group, item.ref.key, item.block_id)))
                          for item in load.items]
                self._count("load", len(load.items), load.started,
                            [t for _, layers in landed for _, views in layers for t in views.values()])
                if self.cfg.audit_path:
                    self._audit([{"event": "load", "request": rid, **self._described(key, name, views)}
                                 for key, layers in landed for name, views in layers])
            elif not load.abandoned and now - load.started > self.cfg.deadline:
                log.warning("statetier: load for request %s not done within %s s: recomputed", rid, self.cfg.deadline)
                self.counts.add("deadline_misses.load")
                load.abandoned = overdue = True
        if overdue:  # the connection goes: its loads fail soon and are reported then; nothing lands after
            self.link.abandon()

    def _refused(self, job: LoadJob, exc: BaseException, reason: str) -> None:
        log.warning("statetier: load for request %s refused (%s): %s; vLLM recomputes it", job.request_id, reason, exc)
        self.counts.add(f"refusals.{reason}")
        self._results.finished.add(job.request_id)
        self._results.failed.add(job.request_id)
        self._failed_blocks.update(job.attention_blocks)
        if self.cfg.audit_path:
            self._audit([{"event": "refused", "request": job.request_id, "tokens": job.tokens,
                          "reason": reason, "error": type(exc).__name__, "message": str(exc)[:500]}])

    def take_results(self, finished_req_ids=()) -> Results:
        self._harvest_loads()
        self._harvest_saves()
        self._finished.update(finished_req_ids)
        for rid in list(self._finished):
            if rid not in self._saves:
                self._finished.discard(rid)  # no save of it: vLLM freed its blocks already
            elif all(save.future.done() for save in self._saves[rid]):
                del self._saves[rid]
                self._finished.discard(rid)
                self._results.sent.add(rid)
        results, self._results = self._results, Results()
        return results

    def take_failed_blocks(self) -> set[int]:
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def take_saved_refs(self) -> dict[str, list]:
        """The refs of the saves answered since the last call, by request (worker metadata)."""
        self._harvest_saves()
        refs, self._saved_refs = self._saved_refs, {}
        return refs

    # -- saves ----------------------------------------------------------------------------

    def save(self, jobs: Sequence[SaveJob]) -> None:
        self._wait_behind({job.request_id for job in jobs})
        for job in jobs:
            job = replace(job, items=tuple(item for item in job.items
                                           if self.layout.group(item.group).saved_by(self.shard)))
            puts = [PutItem(replace(item.key, shard=self.layout.group(item.group).shard_of(self.shard)),
                            self._staged(item), request_id=job.request_id, step=job.step, publish=self.cfg.publish)
                    for item in job.items]
            saves = self._saves.setdefault(job.request_id, [])  # reported in finished_sending, saved or not
            if not puts:
                continue  # a replicated state only: rank 0 saves it
            try:
                future = self.link.submit("put_many", puts)
            except Exception as exc:  # noqa: BLE001 - a lost save is a later miss, never an engine failure
                log.warning("statetier: saving request %s at %d tokens skipped: %s", job.request_id, job.step, exc)
                self.counts.add("saves_skipped")
                continue
            saves.append(_Save(job, puts, future, time.monotonic()))

    def _staged(self, item):
        """A block's pages as views (vLLM keeps the block until the save is reported), or a
        Mamba slot's states copied into tensors this side owns (vLLM writes the slot again
        next step)."""
        regions = self._destination(item.group, item.key, item.block_id)
        if item.key.kind is Kind.KV:
            return regions
        if not item.key.group_layers:
            return {name: view.clone() for name, view in regions.items()}
        return {lid: {name: view.clone() for name, view in views.items()} for lid, views in regions.items()}

    def _wait_behind(self, saving: set[str]) -> None:
        """Earlier saves of requests with none in this step (their prompt is saved: a handoff of
        them may come next), waited on for at most the deadline in all; a request still saving
        is not waited on, so that its saves overlap the steps that compute it."""
        pending = [save.future for rid, saves in self._saves.items() if rid not in saving
                   for save in saves if not save.future.done()]
        if not pending or not self.link.is_answering:
            return
        _, late = concurrent.futures.wait(pending, timeout=self.cfg.deadline)
        if late:
            log.warning("statetier: %d saves not done within %s s; the daemon is suspect", len(late),
                        self.cfg.deadline)
            self.counts.add("deadline_misses.save")
            self.link.overdue(next(iter(late)))
        self._harvest_saves()

    def _harvest_saves(self) -> None:
        for saves in self._saves.values():
            for save in saves:
                if save.future.done() and not save.is_counted:
                    save.is_counted = True
                    self._saved(save)

    def _saved(self, save: _Save) -> None:
        exc = save.future.exception() if not save.future.cancelled() else Unavailable("save cancelled")
        if exc is not None:
            log.warning("statetier: saving request %s at %d tokens failed: %s", save.job.request_id, save.job.step, exc)
            self.link.failed(exc)
            self.counts.add("saves_failed")
            return
        answered = list(save.future.result())
        self._saved_refs.setdefault(save.job.request_id, []).extend(answered)
        sent = [(item, put, ref, self._by_layer(item.group, put.key, put.tensors))
                for item, put, ref in zip(save.job.items, save.puts, answered)]
        self._count("save", len(save.puts), save.started,
                    [t for *_, layers in sent for _, views in layers for t in views.values()])
        if self.cfg.audit_path:
            self._audit([{"event": "save", "request": save.job.request_id, "ref": ref_to_wire(ref),
                          **self._described(put.key, name, views)}
                         for item, put, ref, layers in sent for name, views in layers])

    def flush(self, request_ids: Sequence[str]) -> None:
        """Preempted requests: their saves end before vLLM reuses their blocks. Past the
        deadline the connection is dropped, and the call returns once it sends nothing more."""
        pending = [save.future for rid in request_ids for save in self._saves.get(rid, ()) if not save.future.done()]
        if not pending:
            return
        _, late = concurrent.futures.wait(pending, timeout=self.cfg.deadline)
        if late:
            log.warning("statetier: saves of preempted requests not done within %s s: dropped", self.cfg.deadline)
            self.counts.add("deadline_misses.flush")
            try:
                self.link.abandon().result(timeout=self.cfg.deadline)
            except concurrent.futures.TimeoutError:
                log.warning("statetier: the dropped connection did not close within %s s", self.cfg.deadline)
        self._harvest_saves()

    def _count(self, direction: str, objects: int, started: float, tensors) -> None:
        self.counts.add(f"objects.{direction}", objects)
        self.counts.add(f"bytes.{direction}", sum(t.numel() * t.element_size() for t in tensors))
        self.counts.add(f"seconds.{direction}", time.monotonic() - started)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Every load and save started has ended (tests; shutdown)."""
        pending = [load.future for load in self._loads.values()]
        pending += [save.future for saves in self._saves.values() for save in saves]
        concurrent.futures.wait(pending, timeout=timeout)

    # -- audit -----------------------------------------------------------------------------

    @staticmethod
    def _described(key, layer_name: str, views: Mapping[str, torch.Tensor]) -> dict:
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(views):
            digest.update(name.encode())
            digest.update(byte_view(tensor_bytes(views[name].cpu())))
        return {"layer": layer_name, "kind": key.kind.name.lower(), "shard": key.shard,
                "span": [key.token_start, key.token_end], "digest": digest.hexdigest()}

    def _audit(self, records: list[dict]) -> None:
        now = time.time()
        with open(self.cfg.audit_path, "a") as out:
            for record in records:
                out.write(json.dumps({"t": now, "pid": os.getpid(), **record}, sort_keys=True) + "\n")

    def close(self) -> None:
        self.wait_idle(timeout=self.cfg.deadline)
        self.link.close()


def _numel(shape) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
