"""DESIGN §4: every check raises exactly its own error class, and the first failing check wins.

Each single-fault test builds one object (or one expectation) wrong in exactly one way and
asserts ``type(exc) is X``. Headers that need a field the producer never writes (format
version 2, an unsealed snapshot) are made by editing the header and signing it again with
the same key: the signature covers ``header[:header_len - 32]``.

The order test combines faults: for every set of them, the error raised is the one of the
earliest check in the list.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import (BadSignature, CorruptPayload, DestinationMismatch, FingerprintMismatch,
                                       MalformedState, MisroutedState, NamespaceMismatch, PlacementMismatch,
                                       PositionMismatch, StaleState, StatetierError, TruncatedState, UnknownKey, UnsupportedFormat)
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, StateRef, prefix_hash, stream_id
from statetier.protocol.keyring import Keyring, SigAlg, SigningKey
from statetier.protocol.sealed import Expectation, Opened, VerifiedHeaders, decode_header, open_sealed, seal_object
from tests.support.waiting import wait_until

TOKENS = list(range(500, 600))
NS = NamespaceSpec("org/hybrid", kv_dtype="bfloat16", tp_size=2).namespace()
OTHER_NS = NamespaceSpec("org/hybrid", kv_dtype="bfloat16", tp_size=4).namespace()
KEYRING = Keyring([SigningKey.from_secret(b"k-order!", b"s" * 32)], b"k-order!")

KV_KEY = StateKey(NS, Kind.KV, 5, prefix_hash(TOKENS[:32]), 16, 32, shard=1)
SSM_KEY = StateKey(NS, Kind.SSM, 7, prefix_hash(TOKENS[:48]), 0, 48, shard=1, group_layers=(7, 9))
KV_TENSORS = [(TensorSpec("k", "bfloat16", (16, 4)), bytes(range(128))),
              (TensorSpec("v", "bfloat16", (16, 4)), bytes(range(128, 256)))]
SSM_TENSORS = [(TensorSpec("conv", "bfloat16", (3, 8)), bytes(48)), (TensorSpec("ssm", "float32", (8, 4)), bytes(128))]
SID_1, SID_2, SID_3 = b"A" * 16, b"B" * 16, b"C" * 16


def make(key=KV_KEY, *, request_id="req-1", step=3, state_id=SID_2, version=2, speculative=False,
         keyring=KEYRING) -> tuple[bytes, StateRef]:
    tensors = KV_TENSORS if key.kind is Kind.KV else SSM_TENSORS
    blob = seal_object(key, Provenance(request_id, step, "prefill-0", 1), tensors, keyring=keyring,
                       state_id=state_id, version=version, contains_speculative=speculative)
    return blob, StateRef(key, request_id, step, state_id, version)


def resign(blob: bytes, edit, keyring=KEYRING) -> bytes:
    """Apply ``edit(header: bytearray)`` and sign the header again with the same key."""
    header_len = int.from_bytes(blob[8:12], "little")
    header = bytearray(blob[:header_len])
    edit(header)
    header[-32:] = keyring.active.sign(bytes(header[:-32]))
    return bytes(header) + blob[header_len:]


def flip(blob: bytes, index: int, mask: int = 0x01) -> bytes:
    out = bytearray(blob)
    out[index] ^= mask
    return bytes(out)


def rejects(cls, blob, expect, keyring=KEYRING):
    with pytest.raises(StatetierError) as info:
        open_sealed(blob, expect, keyring)
    assert type(info.value) is cls, f"expected {cls.__name__}, got {type(info.value).__name__}: {info.value}"
    return info.value


def by_ref(ref: StateRef, **extra) -> Expectation:
    return Expectation.for_ref(ref, NS, **extra)


def with_key(expect: Expectation, **changes) -> Expectation:
    return dataclasses.replace(expect, key=dataclasses.replace(expect.key, **changes))


# ---------------------------------------------------------------- the healthy baseline


def test_untouched_objects_open_by_ref_and_by_key():
    for key in (KV_KEY, SSM_KEY):
        blob, ref = make(key)
        assert isinstance(open_sealed(blob, by_ref(ref, newest_version=2, state_id_stream=ref.stream_id), KEYRING), Opened)
        assert isinstance(open_sealed(blob, Expectation.for_key(key), KEYRING), Opened)
        assert isinstance(open_sealed(blob, None, KEYRING), Opened)


# ---------------------------------------------------------------- 1. framing


def test_truncated_object_is_truncated_state():
    blob, ref = make()
    rejects(TruncatedState, blob[:-1], by_ref(ref))
    rejects(TruncatedState, blob[:31], by_ref(ref))
    rejects(TruncatedState, blob[:100], by_ref(ref))


def test_trailing_bytes_are_truncated_state():
    blob, ref = make()
    rejects(TruncatedState, blob + b"\0", by_ref(ref))


def test_bad_magic_is_malformed_state():
    blob, ref = make()
    rejects(MalformedState, b"XTSO" + blob[4:], by_ref(ref))
    rejects(MalformedState, bytes(64), None)


# ---------------------------------------------------------------- 2. signature


def test_wrong_key_with_the_same_id_is_bad_signature():
    blob, ref = make()
    impostor = Keyring([SigningKey.from_secret(b"k-order!", b"t" * 32)], b"k-order!")
    rejects(BadSignature, blob, by_ref(ref), impostor)


def test_unknown_key_id_is_unknown_key():
    blob, ref = make(keyring=Keyring.generate())
    rejects(UnknownKey, blob, by_ref(ref))


def test_retired_key_is_unknown_key():
    keyring = Keyring.generate()
    blob, ref = make(keyring=keyring)
    old = keyring.active.key_id
    keyring.rotate(grace_seconds=3600)
    assert isinstance(open_sealed(blob, by_ref(ref), keyring), Opened)
    keyring.retire(old)
    rejects(UnknownKey, blob, by_ref(ref), keyring)


def test_expired_key_is_unknown_key():
    keyring = Keyring.generate()
    blob, ref = make(keyring=keyring)
    keyring.rotate(grace_seconds=0)
    rotated_at = time.time_ns()  # the old key's not-after is at most this
    wait_until(lambda: time.time_ns() > rotated_at, "the wall clock the keyring reads passed the grace")
    rejects(UnknownKey, blob, by_ref(ref), keyring)


def test_key_past_its_not_after_is_unknown_key():
    key = dataclasses.replace(SigningKey.from_secret(b"k-past!!", b"p" * 32), not_after_ns=time.time_ns() - 1)
    signer = Keyring([dataclasses.replace(key, not_after_ns=None)], key.key_id)
    blob, ref = make(keyring=signer)
    rejects(UnknownKey, blob, by_ref(ref), Keyring([key]))


# ---------------------------------------------------------------- 3. format


def test_correctly_signed_format_4_is_unsupported_format():
    blob, ref = make()
    v4 = resign(blob, lambda h: h.__setitem__(slice(4, 6), (4).to_bytes(2, "little")))
    rejects(UnsupportedFormat, v4, by_ref(ref))
    rejects(UnsupportedFormat, v4, None)


def test_format_2_object_of_a_namespace_a_client_named_is_refused_with_its_reason():
    """Format 2 sealed whatever namespace the client named (a tenant could name another's);
    a correctly signed one is refused, saying why, never read as an owned namespace."""
    blob, ref = make()
    v2 = resign(blob, lambda h: h.__setitem__(slice(4, 6), (2).to_bytes(2, "little")))
    for expect in (by_ref(ref), None):
        with pytest.raises(UnsupportedFormat, match="any tenant could claim"):
            open_sealed(v2, expect, KEYRING)


def test_format_1_object_with_keyed_digests_is_refused_never_misread():
    """Format 1 bound keyed BLAKE3 digests; a correctly signed one is refused, with the reason."""
    import blake3

    blob, ref = make()
    header = decode_header(blob)
    key = KEYRING.active
    material = key.secret if key.alg is SigAlg.HMAC_SHA256 else key.public
    digest_key = blake3.blake3(material, derive_key_context="statetier 2026-11 payload digest key v1").digest()
    payload = blob[header.header_len :]
    assert header.tensors[0].digest != blake3.blake3(payload[: header.tensors[0].region], key=digest_key).digest()
    v1 = resign(blob, lambda h: h.__setitem__(slice(4, 6), (1).to_bytes(2, "little")))
    for expect in (by_ref(ref), None):
        with pytest.raises(UnsupportedFormat, match="keyed payload digests"):
            open_sealed(v1, expect, KEYRING)


def test_signed_header_with_unknown_flags_is_malformed_state():
    blob, ref = make()
    rejects(MalformedState, resign(blob, lambda h: h.__setitem__(33, h[33] | 0x80)), by_ref(ref))


# ---------------------------------------------------------------- 4. namespace


def test_other_namespace_is_namespace_mismatch():
    blob, ref = make()
    rejects(NamespaceMismatch, blob, Expectation.for_ref(ref, OTHER_NS))
    rejects(NamespaceMismatch, blob, Expectation.for_key(dataclasses.replace(KV_KEY, namespace=OTHER_NS)))


# ---------------------------------------------------------------- 5. placement


@pytest.mark.parametrize("change", [{"layer": 6}, {"shard": 0}, {"group_layers": (5,)}], ids=str)
def test_kv_placement_differs_is_placement_mismatch(change):
    blob, ref = make()
    rejects(PlacementMismatch, blob, with_key(by_ref(ref), **change))
    rejects(PlacementMismatch, blob, Expectation.for_key(dataclasses.replace(KV_KEY, **change)))


@pytest.mark.parametrize("change", [{"group_layers": (7,)}, {"group_layers": (9, 7)}, {"group_layers": ()}], ids=str)
def test_ssm_group_layers_differ_is_placement_mismatch(change):
    blob, ref = make(SSM_KEY)
    rejects(PlacementMismatch, blob, with_key(by_ref(ref), **change))


def test_other_kind_is_placement_mismatch():
    blob, ref = make(SSM_KEY)  # span [0, 48): also a valid KV span, so only the kind differs
    rejects(PlacementMismatch, blob, with_key(by_ref(ref), kind=Kind.KV))


# ---------------------------------------------------------------- 6. position


def test_other_prefix_hash_is_position_mismatch():
    blob, ref = make()
    rejects(PositionMismatch, blob, with_key(by_ref(ref), prefix_hash=prefix_hash(TOKENS[1:33])))


@pytest.mark.parametrize("span", [(0, 32), (16, 31), (16, 33), (17, 32)])
def test_other_token_span_is_position_mismatch(span):
    blob, ref = make()
    rejects(PositionMismatch, blob, with_key(by_ref(ref), token_start=span[0], token_end=span[1]))


@pytest.mark.parametrize("delta", [-1, +1])
def test_snapshot_one_token_off_is_position_mismatch(delta):
    blob, ref = make(SSM_KEY)
    rejects(PositionMismatch, blob, with_key(by_ref(ref), token_end=48 + delta))
    # also when the loader hashed the matching prefix for its own position
    rejects(PositionMismatch, blob, with_key(by_ref(ref), token_end=48 + delta,
                                             prefix_hash=prefix_hash(TOKENS[: 48 + delta])))


def test_speculative_snapshot_is_position_mismatch_unless_allowed():
    blob, ref = make(SSM_KEY, speculative=True)
    rejects(PositionMismatch, blob, by_ref(ref))
    rejects(PositionMismatch, blob, Expectation.for_key(SSM_KEY))
    assert open_sealed(blob, by_ref(ref, allow_speculative=True), KEYRING).header.contains_speculative


def test_speculative_kv_page_is_served():
    blob, ref = make(speculative=True)
    assert open_sealed(blob, by_ref(ref), KEYRING).header.contains_speculative


def test_unsealed_snapshot_is_position_mismatch():
    blob, ref = make(SSM_KEY)
    unsealed = resign(blob, lambda h: h.__setitem__(33, h[33] & ~0x02))
    rejects(PositionMismatch, unsealed, by_ref(ref))
    rejects(PositionMismatch, unsealed, by_ref(ref, allow_speculative=True))


# ---------------------------------------------------------------- 7. fingerprint


def test_ref_of_another_request_is_fingerprint_mismatch():
    blob, ref = make()
    rejects(FingerprintMismatch, blob, by_ref(dataclasses.replace(ref, request_id="req-2", fingerprint=b"")))


def test_ref_of_another_step_is_fingerprint_mismatch():
    blob, ref = make()
    rejects(FingerprintMismatch, blob, by_ref(dataclasses.replace(ref, step=4, fingerprint=b"")))


def test_ref_with_an_altered_fingerprint_is_fingerprint_mismatch():
    blob, ref = make()
    forged = dataclasses.replace(ref, fingerprint=bytes(a ^ 1 for a in ref.fingerprint))
    rejects(FingerprintMismatch, blob, by_ref(forged))


def test_by_key_load_ignores_request_and_step():
    blob, _ = make(request_id="other-request", step=99)
    assert open_sealed(blob, Expectation.for_key(KV_KEY), KEYRING).header.provenance.step == 99


# ---------------------------------------------------------------- 8. version and state id


def test_registry_knows_a_newer_version_is_stale_state():
    blob, ref = make()
    rejects(StaleState, blob, by_ref(ref, newest_version=3))
    rejects(StaleState, blob, Expectation.for_key(KV_KEY, newest_version=3))


@pytest.mark.parametrize("stored, error", [
    pytest.param((SID_1, 1), StaleState, id="an_object_older_than_the_ref_is_stale_state"),
    pytest.param((SID_3, 3), StaleState, id="a_superseded_ref_is_stale_state"),
    pytest.param((SID_1, 2), MisroutedState, id="the_same_version_with_another_state_id_is_misrouted_state"),
    pytest.param((SID_2, 5), MisroutedState, id="the_same_state_id_with_another_version_is_misrouted_state"),
])
def test_an_object_of_another_version_or_state_id_than_its_ref_is_refused(stored, error):
    state_id, version = stored
    blob, _ = make(state_id=state_id, version=version)
    _, ref = make(state_id=SID_2, version=2)
    rejects(error, blob, by_ref(ref))


def test_state_id_issued_for_another_stream_is_misrouted_state():
    blob, ref = make()
    other_stream = stream_id(KV_KEY, "req-2")
    rejects(MisroutedState, blob, by_ref(ref, state_id_stream=other_stream))


# ---------------------------------------------------------------- 9. payload


def test_corrupt_payload_byte_is_corrupt_payload():
    blob, ref = make()
    rejects(CorruptPayload, flip(blob, len(blob) - 1), by_ref(ref))
    rejects(CorruptPayload, flip(blob, len(blob) - 1), None)


@pytest.mark.parametrize(
    "tensors",
    [
        (TensorSpec("k", "bfloat16", (16, 4)),),
        (TensorSpec("k", "bfloat16", (16, 4)), TensorSpec("v", "float16", (16, 4))),
        (TensorSpec("k", "bfloat16", (16, 4)), TensorSpec("v", "bfloat16", (4, 16))),
        (TensorSpec("k", "bfloat16", (16, 4)), TensorSpec("w", "bfloat16", (16, 4))),
        (TensorSpec("v", "bfloat16", (16, 4)), TensorSpec("k", "bfloat16", (16, 4))),
    ],
    ids=["missing", "dtype", "shape", "name", "order"],
)
def test_expected_tensor_specs_differ_is_a_destination_mismatch_not_damage(tensors):
    blob, ref = make()
    rejects(DestinationMismatch, blob, by_ref(ref, tensors=tensors))


def test_payload_is_not_hashed_when_verify_payload_is_off():
    blob, ref = make()
    opened = open_sealed(flip(blob, len(blob) - 1), by_ref(ref), KEYRING, verify_payload=False)
    assert opened.payload.nbytes == 256  # trusted-tier fast path: the header is still verified


# ---------------------------------------------------------------- the order


def test_wrong_namespace_and_corrupt_payload_is_namespace_mismatch():
    blob, ref = make()
    rejects(NamespaceMismatch, flip(blob, len(blob) - 1), Expectation.for_ref(ref, OTHER_NS))


def test_bad_signature_and_wrong_namespace_is_bad_signature():
    blob, ref = make()
    header_len = int.from_bytes(blob[8:12], "little")
    rejects(BadSignature, flip(blob, header_len - 1), Expectation.for_ref(ref, OTHER_NS))


def _sig_flip(blob):
    return flip(blob, int.from_bytes(blob[8:12], "little") - 1)


# name: (rank, edit of the blob, edit of the expectation). Blob edits are applied in this
# table's order (re-signing edits before the signature is broken, truncation last but one).
FAULTS = {
    "malformed": (1.0, lambda b: b"XTSO" + b[4:], None),
    "format": (3, lambda b: resign(b, lambda h: h.__setitem__(slice(4, 6), b"\x01\x00")), None),
    "signature": (2, _sig_flip, None),
    "payload": (9.1, lambda b: flip(b, len(b) - 2), None),
    "truncated": (1.1, lambda b: b[:-1], None),
    "namespace": (4, None, lambda e: with_key(e, namespace=OTHER_NS)),
    "placement": (5, None, lambda e: with_key(e, layer=6)),
    "position": (6, None, lambda e: with_key(e, prefix_hash=bytes(32))),
    "fingerprint": (7, None, lambda e: dataclasses.replace(e, step=4, fingerprint=None)),
    "misrouted": (8.0, None, lambda e: dataclasses.replace(e, state_id_stream=bytes(16))),
    "stale": (8.1, None, lambda e: dataclasses.replace(e, newest_version=3)),
    "tensors": (9.0, None, lambda e: dataclasses.replace(e, tensors=(TensorSpec("k", "int8", (1,)),))),
}
ERROR_OF = {
    "malformed": MalformedState, "truncated": TruncatedState, "signature": BadSignature,
    "format": UnsupportedFormat, "namespace": NamespaceMismatch, "placement": PlacementMismatch,
    "position": PositionMismatch, "fingerprint": FingerprintMismatch, "misrouted": MisroutedState,
    "stale": StaleState, "payload": CorruptPayload, "tensors": DestinationMismatch,
}


def test_every_combination_of_faults_raises_the_earliest_check():
    blob, ref = make()
    names = list(FAULTS)
    checked = 0
    for r in range(1, len(names) + 1):
        for combo in itertools.combinations(names, r):
            faulty, expect = blob, by_ref(ref, newest_version=2, state_id_stream=ref.stream_id)
            for name in combo:  # dict order = application order
                _, edit_blob, edit_expect = FAULTS[name]
                if edit_blob:
                    faulty = edit_blob(faulty)
                if edit_expect:
                    expect = edit_expect(expect)
            first = min(combo, key=lambda n: FAULTS[n][0])
            with pytest.raises(StatetierError) as info:
                open_sealed(faulty, expect, KEYRING)
            assert type(info.value) is ERROR_OF[first], (combo, type(info.value).__name__, str(info.value))
            checked += 1
    assert checked == 2 ** len(names) - 1


# ---------------------------------------------------------------- the verified-header cache


def test_a_cached_header_is_checked_again_for_its_key_and_identity_and_other_bytes_miss():
    keyring = Keyring.generate()
    cache = VerifiedHeaders(capacity=2)
    blob, ref = make(keyring=keyring)
    first = open_sealed(blob, by_ref(ref), keyring, verified=cache)
    assert len(cache) == 1 and open_sealed(blob, by_ref(ref), keyring, verified=cache).header is first.header
    with pytest.raises(PlacementMismatch):  # identity is checked on every load, cached or not
        open_sealed(blob, with_key(by_ref(ref), layer=6), keyring, verified=cache)
    rejects(BadSignature, flip(blob, 140), by_ref(ref), keyring)  # other bytes: verified afresh
    with pytest.raises(BadSignature):
        open_sealed(flip(blob, 140), by_ref(ref), keyring, verified=cache)
    old = keyring.active.key_id
    keyring.rotate(grace_seconds=3600)
    keyring.retire(old)
    with pytest.raises(UnknownKey):  # a retired key no longer verifies, cached or not
        open_sealed(blob, by_ref(ref), keyring, verified=cache)


def test_a_cached_header_whose_key_was_replaced_under_the_same_id_is_verified_again():
    keyring = Keyring.generate()
    cache = VerifiedHeaders(capacity=2)
    blob, ref = make(keyring=keyring)
    open_sealed(blob, by_ref(ref), keyring, verified=cache)
    active = keyring.active
    keyring.add(dataclasses.replace(active, secret=bytes(32), _cache={}))  # same id, other secret
    with pytest.raises(BadSignature, match="does not verify"):  # not served from the cache
        open_sealed(blob, by_ref(ref), keyring, verified=cache)
    keyring.add(active)
    assert open_sealed(blob, by_ref(ref), keyring, verified=cache).header.key_id == active.key_id
