"""Tampered, truncated or foreign-signed objects are refused: never a byte of data.

- every single bit of a small object's header, for both signature algorithms, and sampled
  (plus hypothesis-chosen) bits of payloads, for both digest algorithms;
- truncation at every length;
- keys: unknown, rotated out, a consumer holding only public keys, forged key ids.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import (
    BadSignature,
    UnknownKey,
    ConfigError,
    CorruptPayload,
    MalformedState,
    StatetierError,
    TruncatedState,
)
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, StateRef, prefix_hash
from statetier.protocol.keyring import Keyring, SigAlg, SigningKey
from statetier.protocol.sealed import DigestAlg, Expectation, open_sealed, seal_object
from tests.support.waiting import wait_until

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NS = NamespaceSpec("org/tamper").namespace()
KEY = StateKey(NS, Kind.SSM, 2, prefix_hash(list(range(32))), 0, 32, group_layers=(2, 4))
HMAC = Keyring([SigningKey.from_secret(b"tamper01", b"x" * 32)], b"tamper01")
ED25519 = Keyring.generate(SigAlg.ED25519)
KEYRINGS = {SigAlg.HMAC_SHA256: HMAC, SigAlg.ED25519: ED25519}
STATE_ID = bytes(range(16))


def small_tensors():
    rng = random.Random(7)
    return [(TensorSpec("conv", "bfloat16", (3, 5)), rng.randbytes(30)),
            (TensorSpec("ssm", "float32", (5, 4)), rng.randbytes(80))]


def sealed(sig_alg=SigAlg.HMAC_SHA256, digest_alg=DigestAlg.BLAKE3, tensors=None, keyring=None) -> bytes:
    return seal_object(KEY, Provenance("réq-1", 4, "p"), small_tensors() if tensors is None else tensors,
                       keyring=keyring or KEYRINGS[sig_alg], state_id=STATE_ID, version=1, digest_alg=digest_alg)


REF = StateRef(KEY, "réq-1", 4, STATE_ID, 1)


def flip_bit(blob: bytes, bit: int) -> bytes:
    out = bytearray(blob)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def refused(blob, expect, keyring) -> StatetierError:
    """Open must raise a statetier error; returning anything is the failure this file hunts."""
    try:
        opened = open_sealed(blob, expect, keyring)
    except StatetierError as exc:
        return exc
    pytest.fail(f"tampered object was served ({opened.payload.nbytes} payload bytes)")


def header_error_for(offset: int) -> type:
    """Which check a flipped header byte fails: framing for magic and lengths, the key id
    (another id, which this keyring does not hold), else the signature."""
    if offset < 4:
        return MalformedState
    if 8 <= offset < 12 or 16 <= offset < 24:
        return TruncatedState
    if 24 <= offset < 32:
        return UnknownKey
    return BadSignature


# ---------------------------------------------------------------- header bits


@pytest.mark.parametrize("digest_alg", list(DigestAlg), ids=lambda a: a.label)
@pytest.mark.parametrize("sig_alg", list(SigAlg), ids=lambda a: a.label)
def test_every_header_bit_flip_is_refused(sig_alg, digest_alg):
    keyring = KEYRINGS[sig_alg]
    blob = sealed(sig_alg, digest_alg)
    header_len = int.from_bytes(blob[8:12], "little")
    assert open_sealed(blob, Expectation.for_ref(REF, NS), keyring).payload.nbytes > 0
    for bit in range(header_len * 8):
        tampered = flip_bit(blob, bit)
        for expect in (None, Expectation.for_ref(REF, NS)):
            exc = refused(tampered, expect, keyring)
            want = header_error_for(bit // 8)
            assert type(exc) is want, (bit, type(exc).__name__, str(exc))


# ---------------------------------------------------------------- payload bits


@pytest.mark.parametrize("digest_alg", list(DigestAlg), ids=lambda a: a.label)
@pytest.mark.parametrize("sig_alg", list(SigAlg), ids=lambda a: a.label)
def test_sampled_payload_bit_flips_are_corrupt_payload(sig_alg, digest_alg):
    keyring = KEYRINGS[sig_alg]
    rng = random.Random(11)
    tensors = [(TensorSpec("a", "uint8", (1000,)), rng.randbytes(1000)),  # 24 bytes of padding after it
               (TensorSpec("b", "float32", (64, 33)), rng.randbytes(64 * 33 * 4))]
    blob = sealed(sig_alg, digest_alg, tensors)
    header_len = int.from_bytes(blob[8:12], "little")
    payload_bits = (len(blob) - header_len) * 8
    edges = [0, 1, 999 * 8, 1000 * 8, 1023 * 8 + 7, 1024 * 8, payload_bits - 1]  # tensor, padding, next tensor
    for bit in edges + rng.sample(range(payload_bits), 300):
        exc = refused(flip_bit(blob, header_len * 8 + bit), Expectation.for_ref(REF, NS), keyring)
        assert type(exc) is CorruptPayload, (bit, type(exc).__name__)


@PROPS
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    seed=st.integers(0, 2**32),
    where=st.floats(0, 1, exclude_max=True),
    digest_alg=st.sampled_from(DigestAlg),
    sig_alg=st.sampled_from(SigAlg),
)
def test_any_payload_bit_flip_is_corrupt_payload(sizes, seed, where, digest_alg, sig_alg):
    if sum(sizes) == 0:
        sizes = sizes + [1]
    rng = random.Random(seed)
    tensors = [(TensorSpec(f"t{i}", "uint8", (n,)), rng.randbytes(n)) for i, n in enumerate(sizes)]
    blob = sealed(sig_alg, digest_alg, tensors)
    header_len = int.from_bytes(blob[8:12], "little")
    bit = header_len * 8 + int(where * (len(blob) - header_len) * 8)
    exc = refused(flip_bit(blob, bit), None, KEYRINGS[sig_alg])
    assert type(exc) is CorruptPayload


def test_payload_of_another_object_with_the_same_layout_is_corrupt_payload():
    blob = sealed()
    other = sealed(tensors=[(spec, bytes(len(data))) for spec, data in small_tensors()])
    header_len = int.from_bytes(blob[8:12], "little")
    spliced = blob[:header_len] + other[header_len:]
    assert len(spliced) == len(blob)
    assert type(refused(spliced, Expectation.for_ref(REF, NS), HMAC)) is CorruptPayload


# ---------------------------------------------------------------- truncation


@pytest.mark.parametrize("sig_alg", list(SigAlg), ids=lambda a: a.label)
def test_truncation_at_every_length_is_truncated_state(sig_alg):
    keyring = KEYRINGS[sig_alg]
    blob = sealed(sig_alg)
    for length in range(len(blob)):
        exc = refused(blob[:length], None, keyring)
        assert type(exc) is TruncatedState, (length, type(exc).__name__)
        exc = refused(memoryview(blob)[:length], Expectation.for_ref(REF, NS), keyring)
        assert type(exc) is TruncatedState, (length, type(exc).__name__)


def test_truncation_of_an_object_without_payload_is_truncated_state():
    blob = sealed(tensors=[])
    for length in range(len(blob)):
        assert type(refused(blob[:length], None, HMAC)) is TruncatedState


# ---------------------------------------------------------------- keys


def test_blob_signed_by_an_unknown_key_is_refused():
    blob = sealed(keyring=Keyring.generate())
    assert type(refused(blob, None, HMAC)) is UnknownKey
    blob = sealed(keyring=Keyring.generate(SigAlg.ED25519))
    assert type(refused(blob, None, ED25519.trust_store())) is UnknownKey


@pytest.mark.parametrize("sig_alg", list(SigAlg), ids=lambda a: a.label)
def test_blob_signed_by_a_key_rotated_out_with_no_grace_is_refused(sig_alg):
    keyring = Keyring.generate(sig_alg)
    blob = sealed(keyring=keyring)
    keyring.rotate(grace_seconds=0)
    rotated_at = time.time_ns()  # the old key's not-after is at most this
    wait_until(lambda: time.time_ns() > rotated_at, "the wall clock the keyring reads passed the grace")
    assert type(refused(blob, None, keyring)) is UnknownKey
    assert open_sealed(sealed(keyring=keyring), None, keyring).header.key_id == keyring.active.key_id


def test_blob_signed_by_a_key_past_not_after_is_refused():
    signer = Keyring([SigningKey.from_secret(b"expired!", b"e" * 32)], b"expired!")
    blob = sealed(keyring=signer)
    verifier = Keyring([dataclasses.replace(signer.active, not_after_ns=time.time_ns() - 1)])
    assert type(refused(blob, None, verifier)) is UnknownKey


def test_ed25519_consumer_with_only_the_trust_store_verifies_but_cannot_sign():
    producer = Keyring.generate(SigAlg.ED25519)
    consumer = producer.trust_store()
    assert all(key.secret is None for key in consumer.keys)
    blob = sealed(keyring=producer)
    opened = open_sealed(blob, Expectation.for_ref(REF, NS), consumer)
    assert [bytes(v) for _, v in opened.tensor_views()] == [d for _, d in small_tensors()]
    with pytest.raises(ConfigError) as info:
        sealed(keyring=consumer)
    assert type(info.value) is ConfigError
    with pytest.raises(ConfigError) as info:
        consumer.keys[0].sign(b"header")
    assert type(info.value) is ConfigError


def test_hmac_signature_under_a_forged_ed25519_key_id_is_refused():
    producer = Keyring.generate(SigAlg.ED25519)
    consumer = producer.trust_store()
    forged_id = producer.active.key_id
    # the attacker knows the public key id (it is in every header) but not the private seed
    forger = Keyring([SigningKey.from_secret(forged_id, producer.active.public)], forged_id)
    blob = sealed(keyring=forger)
    assert blob[24:32] == forged_id
    assert type(refused(blob, None, consumer)) is BadSignature
    # also with the algorithm byte claiming Ed25519 and an HMAC over that header
    header_len = int.from_bytes(blob[8:12], "little")
    header = bytearray(blob[:header_len])
    header[6] = int(SigAlg.ED25519)
    header[-32:] = forger.active.sign(bytes(header[:-32]))
    assert type(refused(bytes(header) + blob[header_len:], None, consumer)) is BadSignature
