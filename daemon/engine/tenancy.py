"""Tenants: which namespaces are whose, and how many bytes each may keep per tier.

Ownership comes from the authenticated connection, never from a client's spec: every
namespace a request names is replaced by the one its tenant owns
(``protocol.ownership.owned_namespace``) before the engine looks at it —
``own_incoming(item)`` (a put of a batch), ``own_load(req)``, ``own_lookup(req)``,
``owned_ref(tenant, ref)``, at the engine's entry points. A tenant's requests therefore only ever reach namespaces
carrying its own tag, on every daemon and after every restart; nothing is remembered.

``Tenancy(quotas, observer=None)`` — ``quotas`` maps tenant → {tier name → bytes}.

- ``check_namespace(tenant, namespace)`` refuses (``Forbidden``) a namespace another tenant
  owns (a stored header's, for ``statetier inspect``); ``may_see(tenant, namespace)`` asks
  the same; ``owner_of(digest)`` → the tenant whose tag a namespace carries, among the
  tenants this daemon has served (None before it served that tenant: names are not in the
  digest).
- ``first_tier_within_quota(tenant, tiers, nbytes)`` — where a put may start; raises
  ``QuotaExceeded`` when no tier has quota left for the tenant.
- ``charge(tenant, tier, state_id, nbytes)`` / ``refund(tier, state_id)`` keep per-tier
  byte usage of what was stored.
- the ledger ``daemon.engine.placement`` reports every move to, so usage follows the bytes:
  ``copied(src, dst, state_id)`` (write-behind, publish, promotion: the tenant of the source
  copy is charged in ``dst`` too), ``moved(src, dst, state_id)`` (demotion: charged in
  ``dst``, refunded in ``src``), ``dropped(tier, state_id)`` (evicted with no copy kept, or
  deleted), and ``may_copy(src, dst, state_id, nbytes)`` (a copy stays within the quota).
  Each tenant's usage in a tier is thus the bytes of its objects there.
- ``observer`` (optional; ``daemon.engine.announcements.Announcements``) hears each copy
  charged to a tier where it was not (``charged(tenant, tier, state_id)``) and each charge
  given back (``refunded(tenant, tier, state_id)``): the charges are the daemon's record of whose
  object lies in which tier, so they are what its KV events announce.
"""

from __future__ import annotations

from collections import defaultdict

import msgspec

from statetier.protocol.errors import Forbidden, QuotaExceeded
from statetier.protocol.identity import NAMESPACE_BYTES, Namespace
from statetier.protocol.ownership import TAG_BYTES, is_owned_by, owned_key, owned_namespace, owned_ref, tenant_tag

from ..requests import Incoming, LoadRequest, LookupRequest

__all__ = ["Tenancy", "own_incoming", "own_load", "own_lookup", "owned_namespace", "owned_ref"]


def own_incoming(item: Incoming) -> Incoming:
    req = item.req
    key = owned_key(req.tenant, req.key)
    return item if key is req.key else msgspec.structs.replace(item, req=msgspec.structs.replace(req, key=key))


def own_load(req: LoadRequest) -> LoadRequest:
    namespace = owned_namespace(req.tenant, req.namespace)
    ref = None if req.ref is None else owned_ref(req.tenant, req.ref)
    key = None if req.key is None else owned_key(req.tenant, req.key)
    if namespace == req.namespace and ref is req.ref and key is req.key:
        return req
    return msgspec.structs.replace(req, namespace=namespace, ref=ref, key=key)


def own_lookup(req: LookupRequest) -> LookupRequest:
    namespace = owned_namespace(req.tenant, req.namespace)
    return req if namespace == req.namespace else msgspec.structs.replace(req, namespace=namespace)


class Tenancy:
    def __init__(self, quotas: dict[str, dict[str, int]] | None = None, observer=None) -> None:
        self.quotas = {t: dict(q) for t, q in (quotas or {}).items()}
        self.observer = observer
        self._usage: dict[tuple[str, str], int] = defaultdict(int)
        self._charges: dict[tuple[str, bytes], tuple[str, int]] = {}
        self._names: dict[bytes, str] = {}  # tenant tag -> the name it was seen with

    def check_namespace(self, tenant: str, namespace: Namespace) -> None:
        if not is_owned_by(namespace, tenant):
            raise Forbidden(f"namespace {namespace.hex()[:16]}… belongs to another tenant")
        self._names.setdefault(tenant_tag(tenant), tenant)

    def may_see(self, tenant: str, namespace: Namespace) -> bool:
        """``check_namespace`` as a question."""
        return is_owned_by(namespace, tenant)

    def owner_of(self, namespace_digest: bytes) -> str | None:
        return self._names.get(namespace_digest[NAMESPACE_BYTES - TAG_BYTES :])

    def first_tier_within_quota(self, tenant: str, tier_names: list[str], nbytes: int) -> int:
        for index, tier in enumerate(tier_names):
            if not self.would_exceed(tenant, tier, nbytes):
                return index
        raise QuotaExceeded(f"tenant {tenant!r} has no quota left for {nbytes} bytes in any tier")

    def charge(self, tenant: str, tier: str, state_id: bytes, nbytes: int) -> None:
        was = self._uncharge(tier, state_id)
        self._usage[(tenant, tier)] += nbytes
        self._charges[(tier, state_id)] = (tenant, nbytes)
        if was is None and self.observer is not None:
            self.observer.charged(tenant, tier, state_id)

    def would_exceed(self, tenant: str, tier: str, nbytes: int) -> bool:
        limit = self.quotas.get(tenant, {}).get(tier)
        return limit is not None and self._usage[(tenant, tier)] + nbytes > limit

    def refund(self, tier: str, state_id: bytes) -> None:
        charged = self._uncharge(tier, state_id)
        if charged is not None and self.observer is not None:
            self.observer.refunded(charged[0], tier, state_id)

    def _uncharge(self, tier: str, state_id: bytes) -> tuple[str, int] | None:
        charged = self._charges.pop((tier, state_id), None)
        if charged is not None:
            tenant, nbytes = charged
            self._usage[(tenant, tier)] -= nbytes
        return charged

    def may_copy(self, src: str, dst: str, state_id: bytes, nbytes: int) -> bool:
        tenant = self.tenant_of(src, state_id)
        if tenant is None or self.tenant_of(dst, state_id) is not None:
            return True
        return not self.would_exceed(tenant, dst, nbytes)

    def copied(self, src: str, dst: str, state_id: bytes) -> None:
        charged = self._charges.get((src, state_id))
        if charged is not None:
            self.charge(charged[0], dst, state_id, charged[1])

    def moved(self, src: str, dst: str, state_id: bytes) -> None:
        self.copied(src, dst, state_id)
        self.refund(src, state_id)

    def dropped(self, tier: str, state_id: bytes) -> None:
        self.refund(tier, state_id)

    def tenant_of(self, tier: str, state_id: bytes) -> str | None:
        charged = self._charges.get((tier, state_id))
        return charged[0] if charged else None

    def usage(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for (tenant, tier), used in self._usage.items():
            out[tenant][tier] = used
        return dict(out)
