"""``protocol.classify``: the one judgement of a loaded object, the same for every tier.

Stories: an intact object found under another object's id gets the identity reason of what
it is (by ref and by key), never damage; bytes beyond what the header declares are not
judged, fewer are ``truncated``; damage is damage; each refusal maps to one bounded skip
label.
"""

from __future__ import annotations

import pytest

from statetier.protocol.classify import DAMAGE, SKIP_REASONS, classify, is_damage, open_intact, skip_reason
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import (
    UnknownKey,
    BadSignature,
    CorruptPayload,
    FingerprintMismatch,
    MisroutedState,
    PlacementMismatch,
    PositionMismatch,
    RejectedState,
    StaleState,
    TruncatedState,
)
from statetier.protocol.expectation import registry_refusal
from statetier.protocol.identity import (Kind, NamespaceSpec, Provenance, StateKey, StateRef, new_state_id, prefix_hash,
                                        stream_id)
from statetier.protocol.keyring import Keyring, SigningKey
from statetier.protocol.sealed import Expectation, decode_header, seal_object

KEYRING = Keyring.generate()
NS = NamespaceSpec("classify").namespace()
KEY = StateKey(NS, Kind.SSM, 4, prefix_hash(list(range(32))), 0, 32)
TENSORS = [(TensorSpec("ssm", "float32", (8, 4)), bytes(range(128)))]


def sealed(key=KEY, request_id="req", *, speculative=False, version=1, state_id=None, keyring=KEYRING) -> bytes:
    return seal_object(key, Provenance(request_id, 1, "p", 1), TENSORS, keyring=keyring,
                       state_id=state_id or new_state_id(), version=version, contains_speculative=speculative)


def by_ref(blob: bytes, **extra) -> Expectation:
    ref = decode_header(blob).ref()
    return Expectation.for_ref(ref, NS, **extra)


@pytest.mark.parametrize("theirs, error", [
    (lambda: sealed(StateKey(NS, Kind.SSM, 5, KEY.prefix_hash, 0, 32)), PlacementMismatch),
    (lambda: sealed(StateKey(NS, Kind.SSM, 4, prefix_hash(list(range(1, 33))), 0, 32)), PositionMismatch),
    (lambda: sealed(request_id="another"), FingerprintMismatch),
    (lambda: sealed(), MisroutedState),  # the same identity, another state id
])
def test_an_intact_object_under_another_id_gets_its_identity_reason(theirs, error):
    mine = sealed()
    with pytest.raises(RejectedState) as refused:
        classify(theirs(), by_ref(mine), KEYRING, stored_as=decode_header(mine).state_id)
    assert type(refused.value) is error and not is_damage(refused.value)


def test_by_key_the_object_must_be_the_one_the_index_named():
    blob = sealed()
    assert classify(blob, Expectation.for_key(KEY), KEYRING, stored_as=decode_header(blob).state_id)
    with pytest.raises(MisroutedState):  # same key, but filed under another id
        classify(blob, Expectation.for_key(KEY), KEYRING, stored_as=new_state_id())


def test_an_older_attempt_under_the_newer_ones_id_is_stale():
    older, newer = sealed(version=1), sealed(version=2)
    with pytest.raises(StaleState):
        classify(older, by_ref(newer), KEYRING, stored_as=decode_header(newer).state_id)


def test_bytes_past_what_the_header_declares_are_not_judged_and_fewer_are_truncated():
    blob = sealed()
    sid = decode_header(blob).state_id
    assert classify(blob + b"left behind", by_ref(blob), KEYRING, stored_as=sid).payload.nbytes == 128
    assert open_intact(blob + bytes(64), KEYRING).header.state_id == sid
    with pytest.raises(TruncatedState):
        classify(blob[:-1], by_ref(blob), KEYRING, stored_as=sid)


def test_damage_is_damage_whatever_the_identity():
    blob = bytearray(sealed())
    blob[-1] ^= 1
    with pytest.raises(CorruptPayload):
        open_intact(bytes(blob), KEYRING)
    forged = sealed(keyring=Keyring([SigningKey.from_secret(KEYRING.active.key_id, b"f" * 32)], KEYRING.active.key_id))
    with pytest.raises(BadSignature) as forged_refusal:
        open_intact(forged, KEYRING)
    assert is_damage(forged_refusal.value)


def test_a_key_id_this_keyring_lacks_is_not_damage():
    """Another keyring's object (or a rotation rolled out too fast): refused, never dropped."""
    with pytest.raises(UnknownKey) as refused:
        open_intact(sealed(keyring=Keyring.generate()), KEYRING)
    assert isinstance(refused.value, BadSignature) and not is_damage(refused.value)
    assert "keys.keyring_file" in refused.value.message
    assert skip_reason(refused.value) == "unknown_key"


def test_each_refusal_has_one_bounded_skip_label():
    speculative = sealed(speculative=True)
    with pytest.raises(PositionMismatch) as spec:
        classify(speculative, Expectation.for_key(KEY), KEYRING, stored_as=decode_header(speculative).state_id)
    assert skip_reason(spec.value) == "speculative"
    assert skip_reason(PositionMismatch("other tokens")) == "misfiled"
    assert skip_reason(StaleState()) == "stale"
    assert all(skip_reason(cls()) == "damaged" for cls in DAMAGE)
    assert skip_reason(UnknownKey()) == "unknown_key"
    assert set(SKIP_REASONS) == {"speculative", "stale", "damaged", "unknown_key", "misfiled"}


def test_registry_refusal_without_a_copy():
    """With no copy to judge, a ref is refused by what the registry knows alone: its state_id
    issued for another stream, or its version superseded; a ref it knows nothing against, and
    any load by key, are not refused."""
    ref = StateRef(KEY, "req", 1, new_state_id(), 2)
    mine = stream_id(KEY, "req")
    assert registry_refusal(ref.state_id, Expectation.for_ref(ref, NS, state_id_stream=mine, newest_version=2)) is None
    misrouted = registry_refusal(ref.state_id, Expectation.for_ref(ref, NS, state_id_stream=stream_id(KEY, "other")))
    assert isinstance(misrouted, MisroutedState) and ref.state_id.hex() in str(misrouted)
    stale = registry_refusal(ref.state_id, Expectation.for_ref(ref, NS, state_id_stream=mine, newest_version=3))
    assert isinstance(stale, StaleState) and "superseded by 3" in str(stale)
    assert registry_refusal(ref.state_id, Expectation.for_key(KEY, newest_version=3)) is None
