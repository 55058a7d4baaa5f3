"""Hugging Face transformers hybrid caches through statetier: save, look up, restore.

The worked example is docs/integration.md and examples/pd_disaggregation.py. The client
must be built with ``namespace=namespace_for(model)`` (config + weights fingerprint)::

    saved = save_cache(client, model, cache, prompt, request_id="r1", publish=True)
    handoff = saved.to_json()                                   # prefill → decode
    ...
    if lookup_restorable(client, model, prompt) == len(prompt):  # joint hit, all layers
        cache = restore_cache(client, model, SavedState.from_json(handoff), prompt)

- ``adapter.py`` — ``SavedState`` (a KV and an SSM group object); ``save_cache``,
  ``restore_cache``, ``lookup_state``, ``lookup_restorable`` (+ ``_async``); the pure steps
  they are made of (``check_client``, ``groups_of``, ``boundaries_for``, ``state_key``,
  ``put_items``, ``saved_from_refs``, ``saved_from_lookup``, ``expected_refs``, ``fill_cache``).
- ``cache.py`` — a ``DynamicCache``'s layers read and written as records: ``cache_plan``
  (``CachePlan``, ``LayerPlan``), ``kv_tensors``, ``ssm_tensors``, ``apply_kv``, ``apply_ssm``,
  ``new_cache``, ``forward_from``; per-architecture ``Quirks`` (``quirks_for``, ``QUIRKS``);
  ``TENSOR_TABLE`` (every tensor a layer may hold) and ``CHECKED_ON`` (the transformers
  releases it was read against), ``LINEAR_COUNTER``.
- ``identity.py`` — who a model is: ``namespace_for``, ``weights_fingerprint``, ``config_digest``.
"""

from __future__ import annotations

from .adapter import (
    SavedState,
    boundaries_for,
    check_client,
    expected_refs,
    fill_cache,
    groups_of,
    lookup_restorable,
    lookup_restorable_async,
    lookup_state,
    lookup_state_async,
    put_items,
    restore_cache,
    restore_cache_async,
    save_cache,
    save_cache_async,
    saved_from_lookup,
    saved_from_refs,
    state_key,
)
from .cache import (
    CHECKED_ON,
    LINEAR_COUNTER,
    QUIRKS,
    TENSOR_TABLE,
    CachePlan,
    LayerPlan,
    Quirks,
    apply_kv,
    apply_ssm,
    cache_plan,
    forward_from,
    kv_tensors,
    new_cache,
    quirks_for,
    ssm_tensors,
)
from .identity import config_digest, namespace_for, weights_fingerprint

__all__ = [
    "CHECKED_ON", "LINEAR_COUNTER", "QUIRKS", "TENSOR_TABLE", "CachePlan", "LayerPlan", "Quirks", "SavedState",
    "apply_kv", "apply_ssm", "boundaries_for", "cache_plan", "check_client", "config_digest", "expected_refs",
    "fill_cache", "forward_from", "groups_of", "kv_tensors", "lookup_restorable", "lookup_restorable_async",
    "lookup_state", "lookup_state_async", "namespace_for", "new_cache", "put_items", "quirks_for", "restore_cache",
    "restore_cache_async", "save_cache", "save_cache_async", "saved_from_lookup", "saved_from_refs", "ssm_tensors",
    "state_key", "weights_fingerprint",
]
