"""The vLLM v1 KV connector class, composed of its scheduler-side and worker-side calls.

- ``connector_classes()`` → ``StatetierConnector``, ``StatetierConnectorMetadata`` (the step's
  ``StepMeta``, scheduler → workers) and ``StatetierWorkerMetadata`` (the refs each rank's saves
  were answered with, workers → scheduler), built once on first call, when vLLM is imported.
  ``StatetierConnector(vllm_config, role, kv_cache_config)`` is ``KVConnectorBase_V1`` and
  ``SupportsHMA``: ``SchedulerHooks`` (``hooks_scheduler.py``) over ``SchedulerSide`` and
  ``WorkerHooks`` (``hooks_worker.py``) over ``WorkerSide``, and here what both roles share:
  the start (``contract.check_engine``: ``kv_load_failure_policy="recompute"``, no pipeline
  parallelism), stats, ``requires_kv_delivery`` (False: a lost save is a later miss), shutdown.
  Each class is named under the package (``statetier.clients.vllm``), whose ``__getattr__``
  serves them: vLLM loads the connector and pickles the metadata by name.
- ``layout_from_vllm(kv_cache_config)`` → ``EngineLayout``; ``namespace_from_vllm(vllm_config,
  layout, cfg)`` → ``NamespaceSpec`` (model, config digest, weights identity — ``weights.py`` —,
  dtypes, layout, TP size, tenant); ``event_kinds(kv_cache_config)`` → vLLM's
  ``kv_cache_spec_kind`` per group, for the KV events.
- ``connector_events(cfg, scheduler, kv_cache_config, layout)`` → the subscription behind
  ``take_events()`` (``events.py``), or None without ``events_endpoint`` (or, logged, when the
  daemon cannot be reached to learn the topic).

Transfers run across steps, as vLLM's offload connectors do (``scheduler.py``, ``worker.py``):
lookups are never waited on, loads are reported by a later ``get_finished`` (the request waits
in ``WAITING_FOR_REMOTE_KVS``), saves keep their blocks until ``finished_sending``, and a
refused load is recomputed by vLLM. Mamba state: ``mamba_cache_mode`` ``"none"`` or ``"align"``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import TYPE_CHECKING, Any

from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.identity import Kind

from .contract import check_mamba_spec
from .layout import (
    STATE_NAMES,
    CacheGroup,
    ConnectorConfig,
    EngineLayout,
    StateSpec,
    layer_id_of,
    namespace_spec,
    stored_namespace,
)

if TYPE_CHECKING:
    from .scheduler import SchedulerSide

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
            check_mamba_spec(spec)
            count = len(spec.shapes)
            names = [*STATE_NAMES[:count], *(f"state{i}" for i in range(len(STATE_NAMES), count))]
            states = tuple(StateSpec(n, dtype_name(d), tuple(s)) for n, d, s in zip(names, spec.dtypes, spec.shapes))
            groups.append(CacheGroup(index, Kind.SSM, spec.block_size, layers, states,
                                     is_aligned=spec.mamba_cache_mode == "align",
                                     is_replicated=bool(getattr(spec, "tp_replicated", False))))
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


def event_kinds(kv_cache_config) -> dict[int, str]:
    """vLLM's ``kv_cache_spec_kind`` of each group, as its own KV events carry it."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    return {i: get_kv_cache_spec_kind(g.kv_cache_spec).value for i, g in enumerate(kv_cache_config.kv_cache_groups)}


def _build_classes() -> dict[str, type]:
    base: Any = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from .hooks_scheduler import SchedulerHooks
    from .hooks_worker import WorkerHooks
    from .jobs import StepMeta

    class StatetierConnectorMetadata(base.KVConnectorMetadata):
        def __init__(self, step: StepMeta) -> None:
            self.step = step

    class StatetierWorkerMetadata(base.KVConnectorWorkerMetadata):
        def __init__(self, refs: dict[str, list]) -> None:
            self.refs = refs

        def aggregate(self, other):
            merged = {rid: list(refs) for rid, refs in self.refs.items()}
            for rid, refs in getattr(other, "refs", {}).items():
                merged.setdefault(rid, []).extend(refs)
            return StatetierWorkerMetadata(merged)

    class StatetierConnector(SchedulerHooks, WorkerHooks, base.KVConnectorBase_V1, base.SupportsHMA):
        """vLLM's connector interface over ``SchedulerSide`` / ``WorkerSide``."""

        _step_meta_class = StatetierConnectorMetadata
        _worker_meta_class = StatetierWorkerMetadata

        def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            _start(self, vllm_config, role == base.KVConnectorRole.SCHEDULER, kv_cache_config)

        @property
        def requires_kv_delivery(self) -> bool:
            return False  # a best-effort cache: a dropped save is a later miss (vLLM #50297)

        def get_kv_connector_stats(self):
            side: Any = self._scheduler if self._scheduler is not None else self._worker_side
            data = side.counts.take()
            return metric_classes()["StatetierConnectorStats"](data=data) if data else None

        @classmethod
        def build_kv_connector_stats(cls, data=None):
            return metric_classes()["StatetierConnectorStats"](data=dict(data or {}))

        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            return metric_classes()["StatetierPromMetrics"](vllm_config, metric_types, labelnames,
                                                            per_engine_labelvalues)

        def shutdown(self) -> None:
            for side in (self._scheduler, self._worker):
                if side is not None:
                    side.close()

    from .metrics import metric_classes

    built = {"StatetierConnector": StatetierConnector, "StatetierConnectorMetadata": StatetierConnectorMetadata,
             "StatetierWorkerMetadata": StatetierWorkerMetadata}
    for name, cls in built.items():  # found again by name (the package's __getattr__): metadata is pickled
        cls.__qualname__, cls.__module__ = name, __package__
    return built


def _start(connector, vllm_config, is_scheduler: bool, kv_cache_config) -> None:
    """Both roles' start: the engine checked, its layout and namespace, this role's side."""
    from .contract import check_engine, drops_last_block, returns_handoff, saves_decode_tokens
    from .scheduler import SchedulerSide
    from .worker import WorkerSide

    check_engine(vllm_config)
    transfer = vllm_config.kv_transfer_config
    cfg = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
    layout = connector._layout = layout_from_vllm(kv_cache_config)
    spec = namespace_from_vllm(vllm_config, layout, cfg)
    connector._scheduler = connector._worker = None
    connector._event_kinds = {}
    log.info("statetier connector (%s, %s): %s, attention blocks of %d tokens, %d attention + %d Mamba layers, "
             "namespace %s (as statetier ls shows it)", "scheduler" if is_scheduler else "worker", transfer.kv_role,
             cfg.url, layout.block_size, len(layout.attention_layers), len(layout.ssm_layers),
             stored_namespace(cfg, spec))
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if is_scheduler:
        side = connector._scheduler = SchedulerSide(
            cfg, layout, spec, tp_size=tp_size, loads=transfer.is_kv_consumer, saves=transfer.is_kv_producer,
            saves_decode=saves_decode_tokens(cfg, vllm_config), drops_last_block=drops_last_block(vllm_config),
            hands_off=returns_handoff(cfg, transfer.kv_role))
        side.events = connector_events(cfg, side, kv_cache_config, layout)
        connector._event_kinds = event_kinds(kv_cache_config)
    else:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        connector._worker = WorkerSide(cfg, layout, spec, shard=get_tensor_model_parallel_rank())
