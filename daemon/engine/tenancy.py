"""Tenants: who may see which namespace, and how many bytes each may keep per tier.

``Tenancy(quotas)`` — ``quotas`` maps tenant → {tier name → bytes}.

- ``check_namespace(tenant, namespace)`` binds a namespace to the first tenant that uses
  it and refuses every other tenant (``Forbidden``). A namespace digest already mixes in
  the tenant salt, so two tenants only collide when one deliberately names the other's.
  ``may_see(tenant, namespace)`` asks the same without binding; ``owner_of(digest)`` → the
  tenant a namespace is bound to, or None.
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

from statetier.protocol.errors import Forbidden, QuotaExceeded
from statetier.protocol.identity import Namespace


class Tenancy:
    def __init__(self, quotas: dict[str, dict[str, int]] | None = None, observer=None) -> None:
        self.quotas = {t: dict(q) for t, q in (quotas or {}).items()}
        self.observer = observer
        self._namespace_owner: dict[bytes, str] = {}
        self._usage: dict[tuple[str, str], int] = defaultdict(int)
        self._charges: dict[tuple[str, bytes], tuple[str, int]] = {}

    def check_namespace(self, tenant: str, namespace: Namespace) -> None:
        owner = self._namespace_owner.setdefault(namespace.digest, tenant)
        if owner != tenant:
            raise Forbidden(f"namespace {namespace.hex()[:16]}… belongs to another tenant")

    def may_see(self, tenant: str, namespace: Namespace) -> bool:
        """``check_namespace`` as a question, binding nothing: False only for another
        tenant's namespace."""
        return self._namespace_owner.get(namespace.digest, tenant) == tenant

    def owner_of(self, namespace_digest: bytes) -> str | None:
        return self._namespace_owner.get(namespace_digest)

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
