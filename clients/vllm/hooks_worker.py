"""vLLM's worker-side connector calls, forwarded to ``WorkerSide`` (``worker.py``).

``WorkerHooks`` is mixed into ``StatetierConnector`` (``connector.py``); vLLM calls them in each
worker process, per step, around the forward pass:

- ``register_kv_caches`` — the paged buffers and Mamba slots;
- ``handle_preemptions`` — the saves of preempted requests end before their blocks are reused;
- ``start_load_kv`` — the step's loads started (reported by ``get_transfer_results``); the
  per-layer hooks do nothing (loads are whole-request, saves read the blocks in ``wait_for_save``);
- ``wait_for_save`` — the step's saves started;
- ``get_finished`` / ``get_transfer_results`` / ``get_block_ids_with_load_errors`` — loads done
  or refused, finished requests whose saves ended;
- ``build_connector_worker_meta`` — the refs this rank's saves were answered with, for the
  scheduler side's handoffs (``StatetierWorkerMetadata``; vLLM aggregates every rank's).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layout import EngineLayout
    from .worker import WorkerSide


class WorkerHooks:
    _worker: WorkerSide | None
    _layout: EngineLayout
    _worker_meta_class: type  # StatetierWorkerMetadata (connector.py): vLLM's class, built with vLLM

    @property
    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler's statetier connector")
        return self._worker

    def register_kv_caches(self, kv_caches) -> None:
        self._worker_side.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self._worker_side.flush(kv_connector_metadata.step.preempted)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker_side.start_loads(self._get_connector_metadata().step.loads)  # type: ignore[attr-defined]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and reported by get_finished: the request is not running

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # pages are read in wait_for_save, Mamba slots too (they call no per-layer hook)

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():  # type: ignore[attr-defined]
            self._worker_side.save(self._get_connector_metadata().step.saves)  # type: ignore[attr-defined]

    def get_finished(self, finished_req_ids):
        results = self._worker_side.take_results(finished_req_ids)
        return (results.sent or None), (results.finished or None)

    def get_transfer_results(self, finished_req_ids):
        base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        results = self._worker_side.take_results(finished_req_ids)
        failed = results.failed if self._layout.has_several_groups else set()
        return base.KVConnectorTransferResults(finished_sending=results.sent, finished_recving=results.finished,
                                               failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks = self._worker_side.take_failed_blocks()
        return set() if self._layout.has_several_groups else blocks

    def build_connector_worker_meta(self):
        if self._worker is None:
            return None
        refs = self._worker.take_saved_refs()
        return self._worker_meta_class(refs) if refs else None
