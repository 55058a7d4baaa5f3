"""What is stored, by tenant and namespace: ``statetier ls`` and ``statetier purge``.

- ``walk(stack)`` → ``Walked``: every copy on every tier (``Tier.iter_objects``) with the
  namespace and tenant it belongs to. Both come from the tier's metadata (``ObjectMeta``,
  recorded at the put); a copy whose tier did not record its namespace (a disk entry written
  before it did) has its header read through the tier; the tenant falls back to the namespace's
  owner in ``Tenancy``. A tier that cannot be walked (Redis down) is named in ``unavailable``.
- ``listing(stack, tenant, *, everyone)`` → ``{"namespaces": [...], "unavailable": [...]}``: one
  row per (tenant, namespace): objects and bytes (each object once), ``copies`` (an object
  held in host and disk is one object, two copies: what ``statetier stats`` and ``verify``
  count), per tier the copies and their bytes, objects per kind, the oldest and newest
  ``created_at_ns``, and the state ids of its ``NEWEST_IDS`` newest objects (``newest_ids``:
  what ``statetier inspect`` takes). A tenant sees its own rows; ``everyone`` (an operator) sees all.
- ``purge(stack, tenant, *, namespace=None, of_tenant=None, is_operator=False)`` → counts: every
  copy on every tier of the objects of one namespace (which must be the asking tenant's, by
  ``Tenancy`` and by the tenant each copy's put recorded, unless an operator asks), or of every namespace of
  ``of_tenant`` (the asking tenant itself, or any
  tenant for an operator). ``Forbidden`` otherwise. The copies are removed as a delete removes
  one (``daemon.engine.deletion``): under tombstones, so no move copies them meanwhile, swept,
  moves settled, swept again. A tier deletes a leased copy only once its lease ends, so a load
  in flight finishes with the bytes it was given; a load that starts later finds nothing.
  What is put into the namespace while the purge runs stays. With a shared registry (Redis)
  the purge is cluster-wide: a purge mark (scope, cutoff time) is written there
  (``marked`` in the reply), and every daemon sharing it removes its own copies created up
  to the cutoff when it reads the mark (``honour_marks``; ``daemon.redis_watch`` reads them
  on every probe, and at start).

Called by ``Engine.list_objects`` / ``Engine.purge`` (the LIST and PURGE admin frames).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from statetier.protocol.errors import Forbidden, InvalidRequest, StatetierError, Unavailable
from statetier.protocol.identity import Namespace
from statetier.protocol.sealed import decode_header
from statetier.tiers.base import ObjectMeta, Tier

from .stack import Stack

NEWEST_IDS = 3  # state ids listed per row: what `statetier inspect` takes


@dataclass(frozen=True, slots=True)
class Copy:
    tier: Tier
    meta: ObjectMeta
    namespace: bytes  # b"": unknown
    tenant: str  # "": unknown


@dataclass(slots=True)
class Walked:
    copies: list[Copy] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)


async def walk(stack: Stack, tiers: list[Tier] | None = None) -> Walked:
    walked = Walked()
    for tier in stack.tiers if tiers is None else tiers:
        try:
            metas = [meta async for meta in tier.iter_objects()]
        except Unavailable:
            walked.unavailable.append(tier.name)
            continue
        for meta in metas:
            namespace = meta.namespace or await _namespace_from_header(tier, meta)
            tenant = meta.tenant or (stack.tenancy.owner_of(namespace) or "" if namespace else "")
            walked.copies.append(Copy(tier, meta, namespace, tenant))
    return walked


async def _namespace_from_header(tier: Tier, meta: ObjectMeta) -> bytes:
    try:
        lease = await tier.prepare_load(meta.object_id, owner="catalog")
    except StatetierError:
        return b""
    try:
        return decode_header(await tier.read(lease)).key.namespace.digest
    except StatetierError:
        return b""
    finally:
        await tier.complete_load(lease)


async def listing(stack: Stack, tenant: str, *, everyone: bool) -> dict:
    walked = await walk(stack)
    rows: dict[tuple[str, bytes], dict] = {}
    seen: set[tuple[str, bytes, bytes]] = set()
    for copy in walked.copies:
        if not everyone and copy.tenant != tenant:
            continue
        row = rows.setdefault((copy.tenant, copy.namespace), {
            "tenant": copy.tenant, "namespace": copy.namespace.hex(), "objects": 0, "copies": 0, "bytes": 0,
            "tiers": {},
            "kinds": {}, "oldest_ns": None, "newest_ns": None, "newest_ids": []})
        on_tier = row["tiers"].setdefault(copy.tier.name, {"objects": 0, "bytes": 0})
        on_tier["objects"] += 1
        on_tier["bytes"] += copy.meta.size
        row["copies"] += 1
        once = (copy.tenant, copy.namespace, copy.meta.object_id)
        if once in seen:
            continue
        seen.add(once)
        meta = copy.meta
        row["objects"] += 1
        row["bytes"] += meta.size
        kind = meta.kind.name.lower()
        row["kinds"][kind] = row["kinds"].get(kind, 0) + 1
        created = meta.created_at_ns
        row["oldest_ns"] = created if row["oldest_ns"] is None else min(row["oldest_ns"], created)
        row["newest_ns"] = created if row["newest_ns"] is None else max(row["newest_ns"], created)
        _keep_newest(row["newest_ids"], meta)
    for row in rows.values():
        row["newest_ids"] = [object_id.hex() for _, object_id in sorted(row["newest_ids"], reverse=True)]
    ordered = sorted(rows.values(), key=lambda r: (r["tenant"], -r["bytes"], r["namespace"]))
    return {"namespaces": ordered, "unavailable": walked.unavailable}


def _keep_newest(kept: list, meta: ObjectMeta) -> None:
    """The ``NEWEST_IDS`` newest objects of a row, as (created_at_ns, object_id)."""
    kept.append((meta.created_at_ns, meta.object_id))
    if len(kept) > NEWEST_IDS:
        kept.remove(min(kept))


async def purge(stack: Stack, tenant: str, *, namespace: Namespace | None = None, of_tenant: str | None = None,
                is_operator: bool = False) -> dict:
    if (namespace is None) == (of_tenant is None):
        raise InvalidRequest("a purge names a namespace or a tenant")
    if namespace is not None:
        if not is_operator and not stack.tenancy.may_see(tenant, namespace):  # asks; claims nothing
            raise Forbidden(f"namespace {namespace.hex()[:16]}… belongs to another tenant")

        def chosen(copy: Copy) -> bool:
            return copy.namespace == namespace.digest
    else:
        if of_tenant != tenant and not is_operator:
            raise Forbidden(f"only an operator may purge another tenant's state (this connection is tenant "
                            f"{tenant!r})")

        def chosen(copy: Copy) -> bool:
            return copy.tenant == of_tenant
    walked = await walk(stack)
    picked = [copy for copy in walked.copies if chosen(copy)]
    others = {copy.tenant for copy in picked if copy.tenant} - {tenant}
    if others and not is_operator:  # recorded at the put: holds after a restart, and on other nodes' Redis copies
        raise Forbidden("objects of that namespace belong to another tenant")
    cutoff = time.time_ns()
    report = await _remove_picked(stack, picked, walked.unavailable)
    scope = f"ns:{namespace.digest.hex()}" if namespace is not None else f"tenant:{of_tenant}"
    await _mark_everywhere(stack, scope, cutoff, report)
    return report


async def honour_marks(stack: Stack, marks: dict[str, int]) -> dict:
    """Remove this daemon's copies that purge marks (another daemon's purges, through the
    shared registry) name: objects of the scope created up to its cutoff. One walk."""
    namespaces = {bytes.fromhex(s[3:]): c for s, c in marks.items() if s.startswith("ns:")}
    tenants = {s[7:]: c for s, c in marks.items() if s.startswith("tenant:")}

    def marked(copy: Copy) -> bool:
        created = copy.meta.created_at_ns
        return created <= namespaces.get(copy.namespace, -1) or created <= tenants.get(copy.tenant, -1)

    own = [tier for tier in stack.tiers if tier is not stack.publishing.shared]  # Redis's went with the purge
    walked = await walk(stack, own)
    picked = [copy for copy in walked.copies if marked(copy)]
    return await _remove_picked(stack, picked, walked.unavailable, own)


async def _remove_picked(stack: Stack, picked: list[Copy], unavailable: list[str],
                         tiers: list[Tier] | None = None) -> dict:
    ids = list(dict.fromkeys(copy.meta.object_id for copy in picked))
    removed = await _remove_all(stack, ids, unavailable, stack.tiers if tiers is None else tiers)
    for tier_name, count in removed.items():
        stack.metrics.count_purged(tier_name, count)
    sizes = {copy.meta.object_id: copy.meta.size for copy in picked}
    return {"objects": len(ids), "bytes": sum(sizes.values()), "copies": sum(removed.values()), "by_tier": removed,
            "namespaces": len({copy.namespace for copy in picked}), "unavailable": unavailable}


async def _mark_everywhere(stack: Stack, scope: str, cutoff: int, report: dict) -> None:
    """The purge mark in the shared registry, so every daemon sharing Redis removes its copies
    too; ``report["marked"]`` says whether it was written (Redis down: purge again later)."""
    marks, shared = stack.publishing.marks, stack.publishing.shared
    report["marked"] = False
    if marks is None:
        return
    try:
        await marks.mark_purge(scope, cutoff)
        report["marked"] = True
    except Unavailable:
        if shared is not None and shared.name not in report["unavailable"]:
            report["unavailable"].append(shared.name)


async def _remove_all(stack: Stack, ids: list[bytes], unavailable: list[str], tiers: list[Tier]) -> dict[str, int]:
    removed: dict[str, int] = {}
    async with contextlib.AsyncExitStack() as tombstones:
        for object_id in ids:
            await tombstones.enter_async_context(stack.placement.deleting(object_id))
        await _sweep(stack, tiers, ids, removed, unavailable)
        await stack.placement.settle_moves()  # a move begun before may hold a copy between two tiers
        await _sweep(stack, tiers, ids, removed, unavailable)
    return removed


async def _sweep(stack: Stack, tiers: list[Tier], ids: list[bytes], removed: dict[str, int],
                 unavailable: list[str]) -> None:
    for tier in tiers:
        if tier.name in unavailable:
            continue
        for object_id in ids:
            try:
                if await tier.delete(object_id):
                    removed[tier.name] = removed.get(tier.name, 0) + 1
            except Unavailable:
                unavailable.append(tier.name)  # said in the reply: purge again once it is back
                break
            stack.tenancy.refund(tier.name, object_id)
