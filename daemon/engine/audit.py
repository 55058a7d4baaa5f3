"""Looking at what is stored: ``statetier inspect`` and ``statetier verify``, tenant-scoped.

- ``inspect(stack, tenant, state_id)`` → ``{"header", "tiers"}``: the (unverified) header of
  the object stored under ``state_id`` and the tiers holding it; ``Forbidden`` when the
  header's namespace belongs to another tenant (the first tenant to use a namespace owns
  it, ``daemon.engine.tenancy``).
- ``verify_all(stack, tenant=None, progress=None)`` → ``{"checked", "dropped", "misfiled",
  "unknown_key", "by_reason"}``: every object of every tier re-checked; damage dropped and
  counted by reason; an intact object under another object's id reported as ``misfiled``
  and left; one signed under a key id this keyring lacks reported as ``unknown_key`` and
  left (another keyring's object is no damage).

Called by ``Engine.inspect`` / ``Engine.verify_all`` (the INSPECT and VERIFY handlers) with the
engine's ``Stack``; a damaged copy is dropped by ``daemon.engine.deletion.drop_copy``.
"""

from __future__ import annotations

from statetier.protocol.classify import open_intact
from statetier.protocol.errors import NotFound, RejectedState, UnknownKey, Unavailable
from statetier.protocol.identity import Namespace
from statetier.protocol.sealed import decode_header
from statetier.tiers.base import ObjectMeta, Tier

from .deletion import drop_copy
from .stack import Stack


async def inspect(stack: Stack, tenant: str, state_id: bytes) -> dict:
    """The (unverified) header of ``state_id`` and the tiers holding it, for its own
    tenant only: an object of another tenant's namespace is ``Forbidden``."""
    tiers, header = [], None
    for tier in stack.tiers:
        try:
            lease = await tier.prepare_load(state_id, owner="inspect")
        except (NotFound, Unavailable):
            continue
        try:
            tiers.append(tier.name)
            if header is None:
                found = decode_header(await tier.read(lease))
                stack.tenancy.check_namespace(tenant, found.key.namespace)
                header = found.describe()
        except RejectedState as exc:
            header = header or {"error": exc.reason, "message": exc.message}
        finally:
            await tier.complete_load(lease)
    if not tiers:
        raise NotFound(f"state {state_id.hex()} is in no tier")
    return {"header": header, "tiers": tiers}


async def verify_all(stack: Stack, tenant: str | None = None, progress=None) -> dict:
    """Re-check every object in every tier (``statetier verify``): drop what is damaged,
    report (and leave in place, see ``daemon.engine.serving.CopyServer.serve``) intact objects
    stored under another object's id as ``misfiled``. With ``tenant``, intact objects of other tenants'
    namespaces are passed over unreported; damage is dropped whoever it was."""
    report = {"checked": 0, "dropped": 0, "misfiled": 0, "unknown_key": 0, "by_reason": {}}
    metas = []
    for tier in stack.tiers:
        try:
            async for meta in tier.iter_objects():
                metas.append((tier, meta))
        except Unavailable:
            continue
    for done, (tier, meta) in enumerate(metas, 1):
        await _verify_one(stack, tier, meta, tenant, report)
        if progress is not None:
            progress(done, len(metas))
    return report


async def _verify_one(stack: Stack, tier: Tier, meta: ObjectMeta, tenant: str | None, report: dict) -> None:
    try:
        lease = await tier.prepare_load(meta.object_id, owner="verify")
    except (NotFound, Unavailable):
        return
    try:
        blob = await tier.read(lease)
        header = (await stack.run_work(blob.nbytes, lambda: open_intact(blob, stack.keyring))).header
    except UnknownKey as exc:
        await tier.complete_load(lease)
        if tenant is None or (meta.namespace and stack.tenancy.may_see(tenant, Namespace(meta.namespace))):
            report["checked"] += 1
            report["unknown_key"] += 1
            stack.count_rejection(exc, meta.object_id)
        return
    except RejectedState as exc:
        report["checked"] += 1
        report["dropped"] += 1
        report["by_reason"][exc.reason] = report["by_reason"].get(exc.reason, 0) + 1
        stack.count_rejection(exc, meta.object_id)
        await tier.complete_load(lease)
        await drop_copy(stack, tier, meta.object_id)
        return
    await tier.complete_load(lease)
    if tenant is not None and not stack.tenancy.may_see(tenant, header.key.namespace):
        return
    report["checked"] += 1
    if header.state_id != meta.object_id:
        report["misfiled"] += 1
