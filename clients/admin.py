"""The administration calls over one connection, without torch: what ``AsyncClient``'s admin
methods send, and what the ``statetier`` admin commands send (they need no tensors).

- ``stats(conn)``, ``inspect(conn, state_id)`` — the STATS and INSPECT replies.
- ``verify(conn, progress=None, poll_seconds=0.25)`` — the VERIFY report; ``progress(done,
  total)`` is called as the daemon goes (it answers STATS on this connection with
  ``verify_progress`` while the VERIFY runs) and once more at the end.
- ``list_objects(conn, all_tenants=False)`` — the LIST reply: one row per (tenant, namespace).
- ``purge(conn, namespace=None, tenant=None)`` — PURGE of a namespace (hex digest) or of a
  tenant's namespaces; the counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.frames import Op

from .transport import Connection


async def stats(conn: Connection) -> dict:
    return dict((await conn.request(Op.STATS, {})).meta)


async def inspect(conn: Connection, state_id: bytes | str) -> dict:
    text = state_id.hex() if isinstance(state_id, (bytes, bytearray)) else str(state_id)
    return dict((await conn.request(Op.INSPECT, {"state_id": text})).meta)


async def verify(conn: Connection, progress: Callable[[int, int], object] | None = None, *,
                 poll_seconds: float = 0.25) -> dict:
    if progress is None:
        return dict((await conn.request(Op.VERIFY, {})).meta)
    running = asyncio.ensure_future(conn.request(Op.VERIFY, {}))
    try:
        while not running.done():
            await asyncio.wait([running], timeout=poll_seconds)
            if not running.done():
                seen = (await stats(conn)).get("verify_progress")
                if isinstance(seen, dict):
                    progress(int(seen.get("done", 0)), int(seen.get("total", 0)))
        report = dict(running.result().meta)
    finally:
        running.cancel()
    progress(int(report.get("checked", 0)), int(report.get("checked", 0)))
    return report


async def list_objects(conn: Connection, *, all_tenants: bool = False) -> dict:
    return dict((await conn.request(Op.LIST, {"all": bool(all_tenants)})).meta)


async def purge(conn: Connection, namespace: str | None = None, *, tenant: str | None = None) -> dict:
    if (namespace is None) == (tenant is None):
        raise InvalidRequest("a purge names a namespace or a tenant, not both and not neither")
    meta = {"ns": namespace} if namespace is not None else {"tenant": tenant}
    return dict((await conn.request(Op.PURGE, meta)).meta)
