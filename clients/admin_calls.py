"""The administration calls of ``AsyncClient`` (what ``statetier stats/ls/verify/purge`` send).

- ``AdminCalls`` (a ``ClientSession``): ``delete(ref)``, ``stats()``, ``inspect(state_id)``,
  ``verify(progress=)``, ``list_objects(all_tenants=)``, ``purge(namespace | tenant=)``,
  ``ping()``; the frames themselves are ``clients.admin``'s (no torch there, for the CLI).
"""

from __future__ import annotations

import time
from typing import Callable

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.frames import Op
from statetier.protocol.identity import Namespace, NamespaceSpec, StateRef
from statetier.protocol.messages import field, ref_to_wire
from statetier.protocol.ownership import owned_namespace

from . import admin
from .session import ClientSession


class AdminCalls(ClientSession):
    """See the module docstring."""

    # -- administration -----------------------------------------------------------------

    async def delete(self, ref: StateRef) -> int:
        frame = await self._request(Op.DELETE, {"ref": ref_to_wire(ref)})
        return field(frame.meta, "deleted", int, default=0)

    async def stats(self) -> dict:
        return await admin.stats(self._connection())

    async def inspect(self, state_id: bytes | str) -> dict:
        return await admin.inspect(self._connection(), state_id)

    async def verify(self, progress: Callable[[int, int], object] | None = None, *,
                     poll_seconds: float = 0.25) -> dict:
        """Re-check every stored object (of this tenant); the report. ``progress(done, total)``
        is called as the daemon goes, every ``poll_seconds``, and once more at the end."""
        return await admin.verify(self._connection(), progress, poll_seconds=poll_seconds)

    async def list_objects(self, *, all_tenants: bool = False) -> dict:
        """What is stored, one row per (tenant, namespace): objects, bytes, copies per tier,
        objects per kind, oldest and newest ``created_at_ns`` (``statetier ls``). This
        connection's tenant's rows; every tenant's with ``all_tenants`` (an operator only)."""
        return await admin.list_objects(self._connection(), all_tenants=all_tenants)

    async def purge(self, namespace: Namespace | NamespaceSpec | None = None, *, tenant: str | None = None) -> dict:
        """Remove every object of ``namespace`` from every tier, Redis included — or, with
        ``tenant``, of every namespace of that tenant (this connection's own, or any for an
        operator). The default (this client's namespace) and a ``NamespaceSpec`` are sent as
        this connection's tenant owns them, since an operator's digest is taken as it is (as
        ``statetier ls --all`` shows it); a ``Namespace`` is sent as it is. Loads in flight
        finish; counts come back: ``objects``, ``bytes``, ``copies``, ``by_tier``,
        ``namespaces``, ``unavailable``."""
        if tenant is not None:
            if namespace is not None:
                raise InvalidRequest("purge takes a namespace or a tenant, not both")
            return await admin.purge(self._connection(), tenant=tenant)
        if namespace is None:
            namespace = self.owned_namespace
        elif isinstance(namespace, NamespaceSpec):
            namespace = owned_namespace(self._admitted_tenant(), namespace.namespace())
        return await admin.purge(self._connection(), namespace.hex())

    async def ping(self) -> float:
        """One round trip to the daemon; returns its duration in seconds."""
        started = time.perf_counter()
        await self._request(Op.PING, {})
        return time.perf_counter() - started
