"""Owned namespaces: whatever a client names, its tenant's requests reach only namespaces that
tenant owns.

The daemon replaces every namespace a request names by ``owned_namespace(tenant, ns)``; a
namespace handed out in a ref (already its tenant's) is kept, so refs round-trip; a spec
that names another tenant (``NamespaceSpec.tenant``), or a namespace copied from another
tenant's ref, still lands in the requester's own.
"""

from __future__ import annotations

import dataclasses

from statetier.protocol.identity import Kind, NamespaceSpec, StateKey, StateRef, fingerprint, new_state_id
from statetier.protocol.ownership import is_owned_by, owned_key, owned_namespace, owned_ref, tenant_tag

SPEC_OF_A = NamespaceSpec(model_id="jamba-mini", revision="r1", tenant="a")


def key_in(namespace) -> StateKey:
    return StateKey(namespace, Kind.SSM, 3, bytes(range(32)), 0, 64)


def test_an_owned_namespace_carries_its_tenants_tag_and_owning_again_keeps_it():
    owned = owned_namespace("a", SPEC_OF_A.namespace())
    assert owned.digest[16:] == tenant_tag("a") and is_owned_by(owned, "a") and not is_owned_by(owned, "b")
    assert owned_namespace("a", owned) == owned
    assert owned_namespace("a", SPEC_OF_A.namespace()) == owned  # a pure function: every daemon, every restart


def test_a_tenant_naming_another_tenant_in_its_spec_lands_in_its_own_namespace():
    named = SPEC_OF_A.namespace()  # b sends a's spec, tenant field and all
    of_a, of_b = owned_namespace("a", named), owned_namespace("b", named)
    assert of_b != of_a and is_owned_by(of_b, "b")
    assert owned_namespace("b", of_a) != of_a  # a's namespace copied from a's ref: still b's own
    assert is_owned_by(owned_namespace("b", of_a), "b")


def test_tenant_tags_differ_and_names_are_not_confused_by_concatenation():
    assert len({tenant_tag(t) for t in ("a", "b", "ab", "default", "")}) == 5
    named = NamespaceSpec(model_id="m").namespace()
    assert owned_namespace("a", named) != owned_namespace("ab", named)


def test_a_ref_in_the_clients_namespace_is_owned_with_its_fingerprint_recomputed():
    named = SPEC_OF_A.namespace()
    ref = StateRef(key_in(named), "req", 4, new_state_id(), 2)  # as a connector builds one from its key
    owned = owned_ref("a", ref)
    assert owned.key == owned_key("a", ref.key) == dataclasses.replace(ref.key, namespace=owned_namespace("a", named))
    assert owned.fingerprint == fingerprint(owned.key, "req", 4)
    assert (owned.state_id, owned.version, owned.request_id, owned.step) == (ref.state_id, 2, "req", 4)
    assert owned_ref("a", owned) is owned  # a ref the daemon handed out is kept as it is


def test_a_ref_whose_fingerprint_lies_keeps_the_lie_to_be_refused():
    named = SPEC_OF_A.namespace()
    ref = StateRef(key_in(named), "req", 4, new_state_id(), 2, fingerprint=bytes(32))
    owned = owned_ref("a", ref)
    assert owned.key.namespace == owned_namespace("a", named) and owned.fingerprint == bytes(32)
