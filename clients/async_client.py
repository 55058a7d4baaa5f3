"""The asyncio client of the statetier daemon: torch tensors in, verified tensors out.

``AsyncClient(url, *, namespace, tenant, token, ssl, use_shm, producer_id, timeout,
concurrency)`` (``concurrency``: a ``load_many``'s frames in flight, at least 1); ``await
connect()`` / ``await close()`` or ``async with``. One connection carries every call, many
at once. Keys are built in the client's namespace (``kv_key`` / ``ssm_key`` / ``group_key``).

- ``put(key, tensors, *, request_id, step, publish, version, speculative, durable)`` →
  ``StoredRef`` (a ``StateRef`` plus ``tier`` and ``durable``);
  ``put_kv(layer, prefix_hash, token_start, token_end, tensors, ...)`` and
  ``put_ssm(layer, prefix_hash, tokens_absorbed, {"conv": t, "ssm": t}, ...)`` build the key.
- Group objects (one object per block for every layer of a ``LayerGroup``):
  ``group_key(group, prefix_hash, token_start, token_end, *, shard)``; ``put_group(key,
  {layer: {name: tensor}}, ...)``; ``load_group(target, *, layers, into)`` →
  ``{layer: {name: tensor}}``, the whole object or only the chosen layers' regions (the
  daemon sends only those), into the caller's buffers when given.
- ``load(ref_or_key, *, device, expect, into)`` → ``{name: tensor}``, fresh tensors or the
  caller's ``into`` filled in place; ``load_with_ref`` also returns the ``StateRef`` of
  what was loaded. Loads carry the client's own namespace; every tensor is verified
  against the signed header's digests where it lands.
- ``lookup(attention_layers, ssm_layers, boundaries | token_ids=…, groups=…, ...)`` →
  ``LookupResult`` (per-layer objects and group objects alike);
  ``release(lease_ids)`` gives the leases back.
- ``put_many(items)`` / ``load_many(targets, into=…)``: batch frames, one round trip per batch;
  group objects too (a ``PutItem`` of regions; a group target's ``into`` per layer).
- ``delete(ref)``, ``purge(namespace | tenant=)``, ``list_objects(all_tenants=)``, ``stats()``,
  ``inspect(state_id)``, ``verify(progress=)``, ``ping()``.
- ``owned_namespace``: the namespace the daemon stores this client's objects under (its
  tenant's, ``protocol.ownership``); ``events_topic(template)``: its topic in the daemon's KV
  event stream (docs/integration.md).

Its parts, each a ``ClientSession`` (``session.py``: the connection, the keys): the put and
load calls (``transfer_calls.py``), the lookup and leases (``lookup_calls.py``), the
administration (``admin_calls.py``). Through the connection's own shared-memory windows on
a Unix socket (``transfers.py``, ``shm.py``), inline bytes otherwise (TCP, or a process
that cannot map them); batch calls are cut into frames by ``batches.py``. Every failure is
a typed ``statetier.protocol.errors`` error; use after ``close()`` raises ``ClientClosedError``.
"""

from __future__ import annotations

from .admin_calls import AdminCalls
from .lookup_calls import LookupCalls
from .session import DEFAULT_CONCURRENCY, ClientSession
from .transfer_calls import Expect, TransferCalls

__all__ = ["DEFAULT_CONCURRENCY", "AsyncClient", "ClientSession", "Expect"]


class AsyncClient(TransferCalls, LookupCalls, AdminCalls):
    """A connection to the daemon, in one tenant and (for puts and loads) one namespace: the
    calls of its three parts over one ``ClientSession`` (see the module docstring)."""
