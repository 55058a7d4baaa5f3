"""A vLLM v1 KV connector backed by statetier: ``statetier.clients.vllm.StatetierConnector``.

Load it out of tree (docs/integration.md has the whole command)::

    KVTransferConfig(kv_connector="StatetierConnector", kv_connector_module_path="statetier.clients.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",  # kv_producer: handoffs too
                     kv_connector_extra_config={"url": "unix:///run/statetier.sock", "tenant": "default"})

- ``StatetierConnector`` (and its ``StatetierConnectorMetadata`` / ``StatetierWorkerMetadata``)
  — built on first access of the name (``connector.py``, over ``hooks_scheduler.py`` and
  ``hooks_worker.py``), so importing this package needs neither vLLM nor torch;
  ``layout_from_vllm`` and ``namespace_from_vllm`` translate vLLM's configs (``connector.py``);
  ``contract.py``: what the connector requires of an engine, checked at start.
- ``extra_keys.py`` — what vLLM folds into a block's identity (LoRA, images, ``cache_salt``,
  prompt embeddings), keyed alike on every node; ``handoff.py`` — the objects a restore needs,
  the refs a producer's workers report.
- ``scheduler.py`` — ``SchedulerSide``: what to load (handoff or joint-hit lookup);
  ``producer.py`` — what each step saves, the handoff a producer returns. No vLLM, no torch.
- ``worker.py`` — ``WorkerSide``: loads straight into vLLM's blocks and Mamba slots, saves
  from them. torch, no vLLM.
- ``link.py`` — ``DaemonLink``: calls started, never waited on past ``deadline``.
- ``stats.py`` / ``metrics.py`` — the counts; vLLM's ``KVConnectorStats`` and Prometheus view.
- ``jobs.py`` — ``StepMeta``, ``LoadJob``, ``SaveJob``, the handoff: what the scheduler side
  sends its workers each step.
- ``layout.py`` — ``ConnectorConfig`` (``kv_connector_extra_config``), ``EngineLayout`` (the
  KV cache groups as plain values), ``namespace_spec``.
- ``weights.py`` — ``weights_identity`` / ``resolve_fingerprint``: which weights are served
  (safetensors headers, sizes and samples of a local directory, or the hub commit), mixed
  into the namespace; no identity is refused unless ``allow_unidentified_weights``.
- ``tiny_models.py`` — ``python -m statetier.clients.vllm.tiny_models --out DIR``: the tiny
  random-weight models the docs' recipe and ``make test-vllm`` run on (torch, transformers).
"""

from __future__ import annotations

from typing import Any

from .connector import connector_classes, layout_from_vllm, namespace_from_vllm
from .layout import ConnectorConfig, EngineLayout

__all__ = ["StatetierConnector", "layout_from_vllm", "namespace_from_vllm", "ConnectorConfig", "EngineLayout"]


def __getattr__(name: str) -> Any:
    if name in ("StatetierConnector", "StatetierConnectorMetadata", "StatetierWorkerMetadata"):
        return connector_classes()[name]
    if name in ("StatetierConnectorStats", "StatetierPromMetrics"):
        from .metrics import metric_classes

        return metric_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
