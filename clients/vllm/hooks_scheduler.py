"""vLLM's scheduler-side connector calls, forwarded to ``SchedulerSide`` (``scheduler.py``).

``SchedulerHooks`` is mixed into ``StatetierConnector`` (``connector.py``); every method runs on
vLLM's scheduler thread and none waits on the daemon:

- ``get_num_new_matched_tokens`` / ``update_state_after_alloc`` / ``get_loaded_kv_cache_group_ids``
  — admission: ``(None, False)`` while the lookup is on its way, then the hit, loaded async;
- ``get_external_cache_hit_sources`` — the hit's source: ``p2p`` for a producer's handoff,
  ``host`` for the sidecar daemon's lookup (its tiers are host memory, then disk and Redis);
- ``build_connector_meta`` — each step's loads, saves and preempted requests (``StepMeta``); in
  align mode the Mamba boundary states vLLM hands over (``boundary_state_offloads``);
- ``update_connector_output`` — loads done (leases back) and, through the worker metadata
  (``StatetierWorkerMetadata``), the refs every rank's saves were answered with;
- ``request_finished`` / ``request_finished_all_groups`` — ``(delay_free, handoff)`` from those
  refs; ``take_events``, ``reset_cache``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import SchedulerSide


class SchedulerHooks:
    _scheduler: SchedulerSide | None
    _kv_cache_config: object
    _kv_cache_manager: object
    _event_kinds: dict[int, str]
    _step_meta_class: type  # StatetierConnectorMetadata (connector.py): vLLM's class, built with vLLM

    @property
    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on a worker's statetier connector")
        return self._scheduler

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        tokens = self._scheduler_side.matched_tokens(request, num_computed_tokens)
        if tokens is None:  # the daemon's answer is on its way: vLLM asks again next step
            return None, False
        return tokens, tokens > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler_side.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens == 0:
            return {}
        source = self._scheduler_side.hit_source(request.request_id)
        return {CacheHitSource(source): num_external_tokens}

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))  # type: ignore[attr-defined]

    def build_connector_meta(self, scheduler_output):
        from .scheduler import ScheduledStep

        state = scheduler_output.kv_connector_block_state
        steps = []
        for rid, count in scheduler_output.num_scheduled_tokens.items():
            request = self._scheduler_side.saving_request(rid)
            if request is None:
                continue
            block_ids = (state.resolve_block_ids(rid) if state is not None
                         else self._kv_cache_manager.get_block_ids(rid))  # type: ignore[attr-defined]
            # before vLLM adds this step's tokens: build_connector_meta runs first
            steps.append(ScheduledStep(request, request.num_computed_tokens, count, block_ids))
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        boundary_states = getattr(state, "boundary_state_offloads", None) if state is not None else None
        step = self._scheduler_side.build_meta(steps, tuple(preempted), boundary_states)
        return self._step_meta_class(step)

    def update_connector_output(self, connector_output) -> None:
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if worker_meta is not None:
            self._scheduler_side.refs_saved(getattr(worker_meta, "refs", None))
        self._scheduler_side.loads_finished(connector_output.finished_recving or ())

    def request_finished(self, request, block_ids):
        return self._scheduler_side.request_finished(request)

    def request_finished_all_groups(self, request, block_ids):
        return self._scheduler_side.request_finished(request)

    def reset_cache(self) -> bool | None:
        return self._scheduler_side.reset_cache() if self._scheduler is not None else None

    def take_events(self):
        from .events import as_vllm_events

        side = self._scheduler_side
        return as_vllm_events(side.take_events(), side.events, self._event_kinds)
