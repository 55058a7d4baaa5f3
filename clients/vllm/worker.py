"""The worker side of the vLLM connector, as a plain class (torch, no vLLM import).

``WorkerSide(cfg, layout, spec, *, shard, client=None)``; the vLLM adapter calls:

- ``register(kv_caches)`` — vLLM's ``{layer name: tensor}``: an attention layer's paged
  buffer with blocks on dim 0 (one page = ``buffer[block]``), a Mamba layer's raw int8 slots
  (``[blocks, 1, 1, bytes]`` or ``[blocks, bytes]``) whose bytes hold the typed states of
  ``CacheGroup.states`` back to back, as vLLM's ``MambaBase.bind_kv_cache`` reads them.
- ``load(jobs)`` — per request, every object of this TP shard is loaded straight into its
  block or the Mamba slot (``load_many(into=…)``: each load states the expected ref and the
  destination's names, dtypes and shapes; the daemon refuses another object's identity,
  position, version or layout before writing, and the payload is verified where it lands).
  A refused or failed load marks the request failed and vLLM recomputes all of it
  (``kv_load_failure_policy="recompute"``): objects of the request that arrived before the
  refusal are never used (every block is recomputed, and a request recomputed from token 0
  does not read its Mamba slot).
- ``save(jobs)`` — ``put_many`` of the listed pages and Mamba states, straight from the
  engine's buffers (the puts finish before vLLM's next step can write them).
- ``take_results()`` → ``LoadResults(finished, failed)``; ``take_failed_blocks()`` → the
  attention blocks of failed loads (vLLM takes block ids only from single-group layouts).
- ``close()``.

With ``cfg.audit_path`` every page saved or loaded is logged as a JSON line with the
BLAKE2b of its bytes *as they lie in the engine's buffer* (after the load, for loads), and
every refusal with its reason: what the end-to-end test compares across engines.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import torch

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import Kind, NamespaceSpec
from statetier.protocol.messages import ref_to_wire

from ..tensors import byte_view, tensor_bytes, torch_dtype
from ..values import PutItem
from .jobs import LoadItem, LoadJob, SaveJob
from .layout import CacheGroup, ConnectorConfig, EngineLayout

log = logging.getLogger("statetier.vllm")


@dataclass
class LoadResults:
    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, layout: EngineLayout, spec: NamespaceSpec, *, shard: int = 0,
                 client=None) -> None:
        self.cfg, self.layout, self.spec, self.shard = cfg, layout, spec, shard
        self._client = client
        self._pages: dict[str, torch.Tensor] = {}          # attention layer → paged buffer
        self._slots: dict[str, tuple[torch.Tensor, CacheGroup]] = {}  # Mamba layer → raw slots
        self._results = LoadResults()
        self._failed_blocks: set[int] = set()

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

    # -- loads ----------------------------------------------------------------------------

    def load(self, jobs: Sequence[LoadJob]) -> None:
        for job in jobs:
            items = [item for item in job.items if item.ref.key.shard == self.shard]
            try:
                if job.problem:
                    raise InvalidRequest(job.problem)
                self._load_into(items)
            except Exception as exc:  # noqa: BLE001 - any failure means: recompute, never run on it
                self._refused(job, exc)
                continue
            self._results.finished.add(job.request_id)
            if self.cfg.audit_path:
                self._audit([{"event": "load", "request": job.request_id, **self._described(item)} for item in items])

    def _load_into(self, items: Sequence[LoadItem]) -> None:
        """Every item into the engine's own memory: its page, or its Mamba slot's typed states."""
        destinations = [self._views(item.layer_name, item.ref.key.kind, item.block_id) for item in items]
        self._connected().load_many([item.ref for item in items], into=destinations)

    def _refused(self, job: LoadJob, exc: BaseException) -> None:
        reason = getattr(exc, "reason", type(exc).__name__)
        log.warning("statetier: load for request %s refused (%s): %s; vLLM recomputes it", job.request_id, reason, exc)
        self._results.finished.add(job.request_id)
        self._results.failed.add(job.request_id)
        self._failed_blocks.update(job.attention_blocks)
        if self.cfg.audit_path:
            self._audit([{"event": "refused", "request": job.request_id, "tokens": job.tokens,
                          "reason": reason, "error": type(exc).__name__, "message": str(exc)[:500]}])

    def take_results(self) -> LoadResults:
        results, self._results = self._results, LoadResults()
        return results

    def take_failed_blocks(self) -> set[int]:
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    # -- saves ----------------------------------------------------------------------------

    def save(self, jobs: Sequence[SaveJob]) -> None:
        for job in jobs:
            puts = [PutItem(replace(item.key, shard=self.shard),
                            self._views(item.layer_name, item.key.kind, item.block_id),
                            request_id=job.request_id, step=job.step, publish=self.cfg.publish) for item in job.items]
            try:
                refs = self._connected().put_many(puts)
            except Exception as exc:  # noqa: BLE001 - a lost save is a later miss, never an engine failure
                log.warning("statetier: saving request %s at %d tokens failed: %s", job.request_id, job.step, exc)
                continue
            if self.cfg.audit_path:
                self._audit([{"event": "save", "request": job.request_id, "ref": ref_to_wire(ref),
                              **self._described(item, put.key)} for item, put, ref in zip(job.items, puts, refs)])

    # -- audit and daemon -----------------------------------------------------------------

    def _described(self, item, key=None) -> dict:
        key = key if key is not None else item.ref.key
        views = self._views(item.layer_name, key.kind, item.block_id)
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(views):
            digest.update(name.encode())
            digest.update(byte_view(tensor_bytes(views[name].cpu())))
        return {"layer": item.layer_name, "kind": key.kind.name.lower(), "shard": key.shard,
                "span": [key.token_start, key.token_end], "digest": digest.hexdigest()}

    def _audit(self, records: list[dict]) -> None:
        now = time.time()
        with open(self.cfg.audit_path, "a") as out:
            for record in records:
                out.write(json.dumps({"t": now, "pid": os.getpid(), **record}, sort_keys=True) + "\n")

    def _connected(self):
        if self._client is None:
            from ..sync_client import Client

            self._client = Client(self.cfg.url, namespace=self.spec, tenant=self.cfg.tenant, token=self.cfg.token,
                                  timeout=self.cfg.timeout, producer_id=f"vllm-worker-{self.shard}").connect()
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _numel(shape) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
