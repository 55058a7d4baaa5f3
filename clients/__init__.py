"""The statetier client SDK (DESIGN §8); depends on ``statetier.protocol`` only.

- ``AsyncClient``  — asyncio client: put/load KV pages and SSM snapshots as torch tensors,
                     joint-hit ``lookup``, batch calls (``async_client.py``)
- ``Client``       — the same calls, blocking, on a private loop thread (``sync_client.py``)
- ``PutItem``, ``LookupResult``, ``StoredRef`` — batch input, lookup answer, what a put
                     returns (``values.py``); ``BlockTag`` — the engine's block a put names,
                     carried into the daemon's KV events (``protocol.kv_events``)
- ``LayerGroup``   — layers stored together as group objects: one object per block for
                     every layer of the group (KV), or per boundary (SSM)::

                         attention = LayerGroup(Kind.KV, 0, (0, 8, 16, 24))
                         key = client.group_key(attention, prefix_hash, 0, 256)
                         await client.put_group(key, {0: {"k": k0, "v": v0}, 8: {...}, ...},
                                                request_id="r1")
                         tensors = await client.load_group(key)            # {layer: {name: t}}
                         await client.load_group(key, into={8: {"k": k8, "v": v8}})  # one layer
                         hit = await client.lookup(groups=[attention, mamba], token_ids=prompt)

                     ``PutItem`` and ``load_many`` take group objects too; per-layer objects
                     keep working beside them (docs/protocol.md §2.3).
- ``connect``, ``Connection`` — the raw frame connection (``transport.py``)

Underneath: ``transfers.py`` (the put/load exchanges), ``copies.py`` (payload copies,
verified where the bytes land), ``batches.py`` (batch calls cut into frames), ``shm.py``
(the connection's shared-memory windows), ``tensors.py`` (tensor ↔ bytes); under the
connection, ``endpoint.py`` (daemon URLs) and ``handshake.py`` (HELLO / HELLO_OK, the
windows' descriptors). Errors are ``statetier.protocol.errors``.

Engine integrations, one subpackage per family, each built on the SDK above:
``vllm/`` (the vLLM v1 KV connector, ``statetier.clients.vllm.StatetierConnector``),
``sglang/`` (SGLang's HiCache L3 storage, ``statetier.clients.sglang.StatetierHiCacheStorage``),
``transformers/`` (Hugging Face hybrid caches: ``save_cache``, ``restore_cache``, …).

Importing this package loads neither torch nor any server-side dependency: the names
above are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .async_client import AsyncClient
    from .sync_client import Client
    from .transport import Connection, connect
    from .values import BlockTag, LayerGroup, LookupResult, PutItem, StoredRef

_EXPORTS = {
    "AsyncClient": "async_client",
    "Client": "sync_client",
    "Connection": "transport",
    "connect": "transport",
    "BlockTag": "values",
    "LayerGroup": "values",
    "LookupResult": "values",
    "PutItem": "values",
    "StoredRef": "values",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
