"""The vLLM v1 KV connector class over the plain scheduler and worker sides.

- ``connector_classes()`` → ``{"StatetierConnector": …, "StatetierConnectorMetadata": …}``,
  built once on first call, when vLLM is imported: ``StatetierConnector(vllm_config, role,
  kv_cache_config)`` is ``KVConnectorBase_V1`` and ``SupportsHMA`` (hybrid models), and
  forwards vLLM's calls to ``SchedulerSide`` (``scheduler.py``) or ``WorkerSide``
  (``worker.py``). Both classes are named under the package (``statetier.clients.vllm``),
  whose ``__getattr__`` serves them: vLLM loads the connector and pickles the metadata by name.
- ``layout_from_vllm(kv_cache_config)`` → ``EngineLayout``; ``namespace_from_vllm(vllm_config,
  layout, cfg)`` → ``NamespaceSpec`` (model, config digest, weights identity — ``weights.py``:
  ``model_fingerprint``, else derived from the weight files or the hub commit, else refused —,
  dtypes, layout, TP size, tenant).
- ``saves_decode_tokens(cfg, vllm_config)`` — whether producers save decoded tokens' blocks.
- ``connector_events(cfg, scheduler, kv_cache_config, layout)`` → the subscription behind
  ``take_events()`` (``events.py``: the daemon's KV events of the saved blocks, under vLLM's
  hashes, into vLLM's own event stream), or None without ``events_endpoint`` (or, logged, when
  the daemon cannot be reached to learn the topic: the scheduler side connects at start).

Transfers run across steps, as vLLM's offload connectors do: a lookup answers ``None``
until the daemon has (a miss past ``deadline``); loads start in ``start_load_kv`` and are
reported by a later ``get_finished`` (the request waits in ``WAITING_FOR_REMOTE_KVS``: also
the only way vLLM accepts a refused load of a hybrid model); saves start in
``wait_for_save`` and their blocks stay with the connector (``request_finished`` →
``(True, …)``) until ``finished_sending``; ``handle_preemptions`` flushes the saves of
preempted requests; the per-layer hooks do nothing. Both sides count what they do
(``get_kv_connector_stats``: ``metrics.py``, vLLM's log line and Prometheus), and
``reset_cache`` purges this namespace from the daemon. A refused load is reported as failed
block ids (one KV cache group) or as a failed receive (several groups), and vLLM recomputes
the request; the connector never offers the same request a second load. Mamba state
requires ``mamba_cache_mode="none"``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import TYPE_CHECKING, Any

from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.identity import Kind

from .layout import STATE_NAMES, CacheGroup, ConnectorConfig, EngineLayout, StateSpec, layer_id_of, namespace_spec

if TYPE_CHECKING:
    from .scheduler import SchedulerSide
    from .worker import WorkerSide

_built: dict[str, type] = {}
log = logging.getLogger("vllm.statetier")  # under vLLM's logger: shown with vLLM's own lines


def connector_classes() -> dict[str, type]:
    """``StatetierConnector`` and ``StatetierConnectorMetadata``, built (vLLM imported) once."""
    if not _built:
        _built.update(_build_classes())
    return _built


def layout_from_vllm(kv_cache_config) -> EngineLayout:
    """vLLM's KV cache groups as an ``EngineLayout`` (full attention and Mamba "none" only)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from ..tensors import dtype_name

    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        layers = tuple((name, layer_id_of(name)) for name in group.layer_names)
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "none" or spec.num_speculative_blocks:
                raise InvalidRequest("the statetier connector restores Mamba state with mamba_cache_mode='none' "
                                     "and no speculative blocks")
            count = len(spec.shapes)
            names = [*STATE_NAMES[:count], *(f"state{i}" for i in range(len(STATE_NAMES), count))]
            states = tuple(StateSpec(n, dtype_name(d), tuple(s)) for n, d, s in zip(names, spec.dtypes, spec.shapes))
            groups.append(CacheGroup(index, Kind.SSM, spec.block_size, layers, states))
        elif type(spec) is FullAttentionSpec and getattr(spec, "sliding_window", None) is None:
            # exactly: its subclasses (MLA latents, sinks, ring windows) lay pages out otherwise
            kv = StateSpec("kv", dtype_name(spec.dtype), (spec.num_kv_heads, spec.head_size))
            groups.append(CacheGroup(index, Kind.KV, spec.block_size, layers, (kv,)))
        else:
            raise InvalidRequest(f"the statetier connector does not handle {type(spec).__name__} cache groups")
    return EngineLayout(tuple(groups))


def namespace_from_vllm(vllm_config, layout: EngineLayout, cfg: ConnectorConfig):
    from vllm import __version__ as vllm_version
    from vllm.platforms import current_platform

    from ..transformers.identity import config_digest
    from ..tensors import dtype_name
    from .weights import resolve_fingerprint

    model = vllm_config.model_config
    major_minor = ".".join(str(vllm_version).split(".")[:2])
    weights = resolve_fingerprint(cfg, str(model.model), str(model.revision or ""))
    cfg = dataclasses.replace(cfg, model_fingerprint=weights)
    return namespace_spec(cfg, layout, model=str(model.model), revision=str(model.revision or ""),
                          config_digest=config_digest(model.hf_config), weight_dtype=dtype_name(model.dtype),
                          tp_size=vllm_config.parallel_config.tensor_parallel_size,
                          engine_tag=f"vllm-{major_minor}/{current_platform.device_type}")


def connector_events(cfg: ConnectorConfig, scheduler: SchedulerSide, kv_cache_config, layout: EngineLayout):
    """The daemon's KV events for ``take_events()`` (``events.py``), when ``events_endpoint`` is
    set: the topic is the scheduler side's owned namespace's, which its connection tells."""
    if not cfg.events_endpoint:
        return None
    from .events import ConnectorEvents

    try:
        topic = scheduler.events_topic(cfg.events_topic)
    except (StatetierError, OSError) as exc:  # an unreachable daemon is never an engine failure
        log.warning("statetier: no KV events from the daemon in take_events(): %s", exc)
        return None
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or layout.block_size
    return ConnectorEvents(cfg.events_endpoint, topic, hash_block_size)


def saves_decode_tokens(cfg: ConnectorConfig, vllm_config) -> bool:
    """``save_decode_tokens``, by default on with prefix caching (multi-turn reuse) and off
    under speculative decoding (its scheduled tokens are not all kept)."""
    if cfg.save_decode_tokens is not None:
        return cfg.save_decode_tokens
    return bool(vllm_config.cache_config.enable_prefix_caching) and vllm_config.speculative_config is None


def _build_classes() -> dict[str, type]:
    base: Any = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from .jobs import StepMeta
    from .metrics import metric_classes
    from .scheduler import ScheduledStep, SchedulerSide
    from .worker import WorkerSide

    class StatetierConnectorMetadata(base.KVConnectorMetadata):
        def __init__(self, step: StepMeta) -> None:
            self.step = step

    class StatetierConnector(base.KVConnectorBase_V1, base.SupportsHMA):
        """vLLM's connector interface over ``SchedulerSide`` / ``WorkerSide``."""

        def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            transfer = self._kv_transfer_config
            cfg = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
            self._layout = layout_from_vllm(kv_cache_config)
            spec = namespace_from_vllm(vllm_config, self._layout, cfg)
            self._scheduler: SchedulerSide | None = None
            self._worker: WorkerSide | None = None
            log.info("statetier connector (%s, %s): %s, attention blocks of %d tokens, %d attention + %d Mamba "
                     "layers, namespace %s", role.name.lower(), transfer.kv_role, cfg.url, self._layout.block_size,
                     len(self._layout.attention_layers), len(self._layout.ssm_layers), spec.namespace().hex()[:16])
            if role == base.KVConnectorRole.SCHEDULER:
                self._scheduler = SchedulerSide(cfg, self._layout, spec,
                                                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                                                loads=transfer.is_kv_consumer, saves=transfer.is_kv_producer,
                                                saves_decode=saves_decode_tokens(cfg, vllm_config))
                self._scheduler.events = connector_events(cfg, self._scheduler, kv_cache_config, self._layout)
            else:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                self._worker = WorkerSide(cfg, self._layout, spec, shard=get_tensor_model_parallel_rank())

        @property
        def _scheduler_side(self) -> SchedulerSide:
            if self._scheduler is None:
                raise RuntimeError("a scheduler-side call on a worker's statetier connector")
            return self._scheduler

        @property
        def _worker_side(self) -> WorkerSide:
            if self._worker is None:
                raise RuntimeError("a worker-side call on the scheduler's statetier connector")
            return self._worker

        # -- scheduler side ---------------------------------------------------------------

        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            tokens = self._scheduler_side.matched_tokens(request, num_computed_tokens)
            if tokens is None:  # the daemon's answer is on its way: vLLM asks again next step
                return None, False
            return tokens, tokens > 0

        def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
            self._scheduler_side.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

        def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
            return tuple(range(len(self._kv_cache_config.kv_cache_groups)))  # every group, Mamba included

        def build_connector_meta(self, scheduler_output):
            state = scheduler_output.kv_connector_block_state
            steps = []
            for rid, count in scheduler_output.num_scheduled_tokens.items():
                request = self._scheduler_side.saving_request(rid)
                if request is None:
                    continue
                block_ids = (state.resolve_block_ids(rid) if state is not None
                             else self._kv_cache_manager.get_block_ids(rid))
                # before vLLM adds this step's tokens: build_connector_meta runs first
                steps.append(ScheduledStep(request, request.num_computed_tokens, count, block_ids))
            preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
            return StatetierConnectorMetadata(self._scheduler_side.build_meta(steps, tuple(preempted)))

        def update_connector_output(self, connector_output) -> None:
            self._scheduler_side.loads_finished(connector_output.finished_recving or ())

        def request_finished(self, request, block_ids):
            return self._scheduler_side.request_finished(request)

        def reset_cache(self) -> bool | None:
            return self._scheduler_side.reset_cache() if self._scheduler is not None else None

        def get_kv_connector_stats(self):
            side: SchedulerSide | WorkerSide = self._scheduler if self._scheduler is not None else self._worker_side
            data = side.counts.take()
            return metric_classes()["StatetierConnectorStats"](data=data) if data else None

        @classmethod
        def build_kv_connector_stats(cls, data=None):
            return metric_classes()["StatetierConnectorStats"](data=dict(data or {}))

        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            return metric_classes()["StatetierPromMetrics"](vllm_config, metric_types, labelnames,
                                                            per_engine_labelvalues)

        def take_events(self):
            from .events import as_vllm_events

            return as_vllm_events(self._scheduler_side.take_events())

        def request_finished_all_groups(self, request, block_ids):
            return self._scheduler_side.request_finished(request)

        # -- worker side ------------------------------------------------------------------

        def register_kv_caches(self, kv_caches) -> None:
            self._worker_side.register(kv_caches)

        def handle_preemptions(self, kv_connector_metadata) -> None:
            self._worker_side.flush(kv_connector_metadata.step.preempted)

        def start_load_kv(self, forward_context, **kwargs) -> None:
            self._worker_side.start_loads(self._get_connector_metadata().step.loads)

        def wait_for_layer_load(self, layer_name: str) -> None:
            return  # loads are whole-request and reported by get_finished: the request is not running

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
            return  # pages are read in wait_for_save, Mamba slots too (they call no per-layer hook)

        def wait_for_save(self) -> None:
            if self.has_connector_metadata():
                self._worker_side.save(self._get_connector_metadata().step.saves)

        def get_finished(self, finished_req_ids):
            results = self._worker_side.take_results(finished_req_ids)
            return (results.sent or None), (results.finished or None)

        def get_transfer_results(self, finished_req_ids):
            results = self._worker_side.take_results(finished_req_ids)
            failed = results.failed if self._layout.has_several_groups else set()
            return base.KVConnectorTransferResults(finished_sending=results.sent, finished_recving=results.finished,
                                                   failed_recving=failed)

        def get_block_ids_with_load_errors(self) -> set[int]:
            blocks = self._worker_side.take_failed_blocks()
            return set() if self._layout.has_several_groups else blocks

        def shutdown(self) -> None:
            for side in (self._scheduler, self._worker):
                if side is not None:
                    side.close()

    built = {"StatetierConnector": StatetierConnector, "StatetierConnectorMetadata": StatetierConnectorMetadata}
    for name, cls in built.items():  # found again by name (the package's __getattr__): metadata is pickled
        cls.__qualname__, cls.__module__ = name, __package__
    return built
