"""SGLang HiCache "L3 storage" backed by statetier: ``statetier.clients.sglang.StatetierHiCacheStorage``.

SGLang loads it by module path and class name::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
      "backend_name": "statetier", "module_path": "statetier.clients.sglang",
      "class_name": "StatetierHiCacheStorage", "interface_v1": 1,
      "hicache_storage_pass_prefix_keys": true,
      "url": "unix:///run/statetier/statetier.sock", "weights_revision": "<commit>"}'

- ``StatetierHiCacheStorage(storage_config, kwargs=None)`` — a subclass of SGLang's
  ``HiCacheStorage`` when SGLang is installed (built on first access of the name, so this
  package imports without SGLang), the plain ``HiCacheBackend`` otherwise.
- ``backend.py`` — ``HiCacheBackend``: SGLang's batch calls (exists / set / get, v1 and the
  hybrid v2) over one blocking ``Client``; ``TransferResult`` when SGLang is absent.
- ``identity.py`` — ``BackendOptions`` (the extra config), ``HiCacheIdentity`` (namespace,
  shard and keys of a page or Mamba slot), ``prefix_bytes`` (a page hash as a prefix hash).
- ``pages.py`` — ``PoolPages``: a host pool's slot as named tensors over the pool's memory.
"""

from __future__ import annotations

from typing import Any

from .backend import HiCacheBackend, TransferResult, storage_class
from .identity import BackendOptions, HiCacheIdentity, prefix_bytes

__all__ = ["BackendOptions", "HiCacheBackend", "HiCacheIdentity", "StatetierHiCacheStorage", "TransferResult",
           "prefix_bytes"]


def __getattr__(name: str) -> Any:
    if name == "StatetierHiCacheStorage":
        cls = storage_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
