"""Namespaces owned by tenants: the daemon, not the client, decides whose a namespace is.

A client names its namespace (``NamespaceSpec.namespace()``, a digest of its model, layout
and so on, or any 32 bytes); the daemon stores and looks up under the *owned* namespace of
the tenant its connection authenticated as:

    owned = BLAKE2b-128("statetier/owned-namespace/1" ‖ tenant ‖ namespace) ‖ tenant_tag(tenant)
    tenant_tag(tenant) = BLAKE2b-128("statetier/tenant/1" ‖ tenant)

so the last 16 bytes of every stored namespace say which tenant owns it, and no request of
another tenant can produce a namespace ending in that tag, whatever its spec says (the
``tenant`` field of a ``NamespaceSpec`` included). The derivation is a pure function of the
tenant's name and the client's namespace: it survives restarts and is the same on every
daemon (tenant names are cluster-wide identities: give one tenant the same name everywhere).

- ``tenant_tag(tenant)``, ``is_owned_by(namespace, tenant)``.
- ``owned_namespace(tenant, namespace)`` — idempotent: a namespace that already carries the
  tenant's tag (one the daemon handed out in a ref) is kept as it is.
- ``owned_key(tenant, key)``, ``owned_ref(tenant, ref)`` — the same for a key and a ref. A
  ref whose namespace changes gets its fingerprint recomputed when its own was consistent
  with its identity, and keeps it (to be refused as ``FingerprintMismatch``) otherwise.
"""

from __future__ import annotations

import functools
import hashlib

from .identity import NAMESPACE_BYTES, Namespace, StateKey, StateRef, fingerprint

TAG_BYTES = 16
_OWNED = b"statetier/owned-namespace/1"
_TAG = b"statetier/tenant/1"


@functools.lru_cache(maxsize=1024)
def tenant_tag(tenant: str) -> bytes:
    raw = tenant.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(_TAG + len(raw).to_bytes(4, "little") + raw, digest_size=TAG_BYTES).digest()


def is_owned_by(namespace: Namespace, tenant: str) -> bool:
    return namespace.digest[NAMESPACE_BYTES - TAG_BYTES :] == tenant_tag(tenant)


def owned_namespace(tenant: str, namespace: Namespace) -> Namespace:
    if is_owned_by(namespace, tenant):
        return namespace
    return _derived_namespace(tenant, namespace)


@functools.lru_cache(maxsize=4096)  # a batch's items, a worker's requests: mostly one namespace
def _derived_namespace(tenant: str, namespace: Namespace) -> Namespace:
    raw = tenant.encode("utf-8", "surrogatepass")
    body = _OWNED + len(raw).to_bytes(4, "little") + raw + namespace.digest
    head = hashlib.blake2b(body, digest_size=NAMESPACE_BYTES - TAG_BYTES).digest()
    return Namespace(head + tenant_tag(tenant))


def owned_key(tenant: str, key: StateKey) -> StateKey:
    namespace = owned_namespace(tenant, key.namespace)
    if namespace is key.namespace:
        return key
    return StateKey.from_checked(namespace, key.kind, key.layer, key.prefix_hash, key.token_start, key.token_end,
                                 key.shard, key.group_layers)  # only the namespace changes: the rest was checked


def owned_ref(tenant: str, ref: StateRef) -> StateRef:
    key = owned_key(tenant, ref.key)
    if key is ref.key:
        return ref
    is_consistent = ref.fingerprint == fingerprint(ref.key, ref.request_id, ref.step)
    return StateRef(key, ref.request_id, ref.step, ref.state_id, ref.version,
                    b"" if is_consistent else ref.fingerprint)
