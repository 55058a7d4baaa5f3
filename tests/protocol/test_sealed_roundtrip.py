"""Sealed objects round-trip every identity and header field, byte for byte.

- property tests: any key, provenance, flags, digest and signature algorithm, and any set of
  tensors (none, zero-size, many) survive ``seal_object`` → ``decode_header`` /
  ``open_sealed``, and ``describe()`` tells the same story;
- the header layout of docs/protocol.md: the fixed-part table is parsed out of the doc and
  used to read a real header with ``struct``, and the variable part is walked by hand.
"""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statetier.protocol import dtypes
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import CorruptPayload, InvalidRequest
from statetier.protocol.identity import (Kind, NamespaceSpec, Provenance, StateKey, StateRef, fingerprint,
                                         new_state_id, prefix_hash)
from statetier.protocol.keyring import Keyring, SigAlg, dev_keyring
from statetier.protocol.sealed import (DigestAlg, Expectation, decode_header, header_length, layout_payload, open_sealed,
                                       parse_header, seal, seal_object, verify_payload_only)
from statetier.protocol.sealed_format import ALIGN, FIXED_BYTES, FLAG_SEALED, FLAG_SPECULATIVE, MAGIC

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

HMAC = dev_keyring()
ED25519 = Keyring.generate(SigAlg.ED25519)
KEYRINGS = {SigAlg.HMAC_SHA256: HMAC, SigAlg.ED25519: ED25519}

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
short_text = st.text(max_size=30)
dtype_names = st.sampled_from(sorted(dtypes.DTYPES))


@st.composite
def state_keys(draw):
    kind = draw(st.sampled_from(Kind))
    start = 0 if kind is Kind.SSM else draw(st.integers(0, 2**63))
    namespace = NamespaceSpec(
        draw(short_text), kv_block_size=draw(st.integers(1, 256)), tp_size=draw(st.integers(1, 16)),
        tenant=draw(short_text),
    ).namespace()
    return StateKey(
        namespace, kind, draw(u32), draw(st.binary(min_size=32, max_size=32)), start,
        start + draw(st.integers(0, 2**62)), draw(st.integers(0, 0xFFFF)),
        tuple(draw(st.lists(u32, max_size=8))),
    )


@st.composite
def tensor_lists(draw):
    specs = draw(
        st.lists(
            st.builds(TensorSpec, short_text, dtype_names, st.lists(st.integers(0, 5), max_size=3).map(tuple)),
            max_size=5,
        )
    )
    rng = random.Random(draw(st.integers(0, 2**32)))
    return [(spec, rng.randbytes(spec.nbytes)) for spec in specs]


def objects():
    return st.fixed_dictionaries(
        {
            "key": state_keys(),
            "provenance": st.builds(Provenance, st.text(max_size=60), u64, short_text, u64),
            "tensors": tensor_lists(),
            "state_id": st.binary(min_size=16, max_size=16),
            "version": u64,
            "digest_alg": st.sampled_from(DigestAlg),
            "sig_alg": st.sampled_from(SigAlg),
            "contains_speculative": st.booleans(),
        }
    )


def _seal(obj) -> bytes:
    return seal_object(
        obj["key"], obj["provenance"], obj["tensors"], keyring=KEYRINGS[obj["sig_alg"]],
        state_id=obj["state_id"], version=obj["version"], digest_alg=obj["digest_alg"],
        contains_speculative=obj["contains_speculative"],
    )


def _ref(obj) -> StateRef:
    prov = obj["provenance"]
    return StateRef(obj["key"], prov.request_id, prov.step, obj["state_id"], obj["version"])


@PROPS
@given(obj=objects())
def test_every_field_round_trips_through_the_header(obj):
    blob = _seal(obj)
    header = decode_header(blob)
    key, prov = obj["key"], obj["provenance"]
    assert header.key == key
    assert header.provenance == prov
    assert header.state_id == obj["state_id"] and header.version == obj["version"]
    assert header.fingerprint == fingerprint(key, prov.request_id, prov.step)
    assert header.ref() == _ref(obj)
    assert header.contains_speculative is obj["contains_speculative"]
    assert header.is_sealed
    assert header.flags == FLAG_SEALED | (FLAG_SPECULATIVE if obj["contains_speculative"] else 0)
    assert header.digest_alg is obj["digest_alg"] and header.sig_alg is obj["sig_alg"]
    assert header.key_id == KEYRINGS[obj["sig_alg"]].active.key_id
    assert header.format_version == 3
    assert header.header_len % ALIGN == 0 and header.header_len >= FIXED_BYTES + 32
    assert len(blob) == header.header_len + header.payload_len
    specs = [spec for spec, _ in obj["tensors"]]
    assert header_length(key, prov, specs, obj["sig_alg"]) == header.header_len
    assert [t.spec for t in header.tensors] == specs
    assert all(t.offset % ALIGN == 0 for t in header.tensors)


@PROPS
@given(obj=objects())
def test_open_returns_exactly_the_sealed_bytes(obj):
    blob = _seal(obj)
    keyring = KEYRINGS[obj["sig_alg"]]
    ns = obj["key"].namespace
    specs = tuple(spec for spec, _ in obj["tensors"])
    opened = open_sealed(blob, Expectation.for_ref(_ref(obj), ns, tensors=specs, allow_speculative=True), keyring)
    assert opened.header == decode_header(blob)
    views = opened.tensor_views()
    assert [spec for spec, _ in views] == list(specs)
    assert [bytes(view) for _, view in views] == [data for _, data in obj["tensors"]]
    # a by-key load of the same object (prefix reuse) sees the same bytes
    by_key = open_sealed(blob, Expectation.for_key(obj["key"], allow_speculative=True), keyring)
    assert bytes(by_key.payload) == bytes(opened.payload)


@PROPS
@given(obj=objects())
def test_describe_tells_the_same_story_as_the_header(obj):
    blob = _seal(obj)
    header = decode_header(blob)
    info = header.describe()
    key, prov = obj["key"], obj["provenance"]
    assert json.loads(json.dumps(info)) == info
    assert info == {
        "format_version": 3,
        "kind": key.kind.name.lower(),
        "namespace": key.namespace.hex(),
        "layer": key.layer,
        "group_layers": list(key.group_layers),
        "shard": key.shard,
        "prefix_hash": key.prefix_hash.hex(),
        "token_start": key.token_start,
        "token_end": key.token_end,
        "request_id": prov.request_id,
        "step": prov.step,
        "producer_id": prov.producer_id,
        "created_at_ns": prov.created_at_ns,
        "state_id": obj["state_id"].hex(),
        "version": obj["version"],
        "fingerprint": fingerprint(key, prov.request_id, prov.step).hex(),
        "flags": {"contains_speculative": obj["contains_speculative"], "sealed": True},
        "digest_alg": {DigestAlg.BLAKE3: "blake3", DigestAlg.XXH3_128: "xxh3-128"}[obj["digest_alg"]],
        "payload_digest": header.payload_digest.hex(),
        "sig_alg": {SigAlg.HMAC_SHA256: "hmac-sha256", SigAlg.ED25519: "ed25519"}[obj["sig_alg"]],
        "key_id": KEYRINGS[obj["sig_alg"]].active.key_id.hex(),
        "header_len": len(blob) - sum(t.region for t in header.tensors),
        "payload_len": sum(t.region for t in header.tensors),
        "tensors": [
            {"name": t.spec.name, "dtype": t.spec.dtype, "shape": list(t.spec.shape), "offset": t.offset,
             "nbytes": t.spec.nbytes, "digest": t.digest.hex()}
            for t in header.tensors
        ],
    }


# ------------------------------------------------------------------ fixed examples

NS = NamespaceSpec("org/hybrid-7b", kv_dtype="bfloat16", ssm_dtype="float32").namespace()


def _kv_key(**changes) -> StateKey:
    base = dict(namespace=NS, kind=Kind.KV, layer=5, prefix_hash=prefix_hash(list(range(32))),
                token_start=16, token_end=32)
    base.update(changes)
    return StateKey(**base)


@pytest.mark.parametrize("digest_alg", list(DigestAlg), ids=lambda a: a.label)
@pytest.mark.parametrize("sig_alg", list(SigAlg), ids=lambda a: a.label)
def test_empty_payload_round_trips(sig_alg, digest_alg):
    keyring = KEYRINGS[sig_alg]
    blob = seal_object(_kv_key(), Provenance("r"), [], keyring=keyring, state_id=new_state_id(), version=1,
                       digest_alg=digest_alg)
    opened = open_sealed(blob, Expectation.for_key(_kv_key(), tensors=()), keyring)
    assert opened.header.tensors == () and opened.payload.nbytes == 0
    assert len(blob) == opened.header.header_len


def test_zero_size_tensors_round_trip_between_real_ones():
    tensors = [
        (TensorSpec("empty0", "float32", (0,)), b""),
        (TensorSpec("a", "uint8", (3,)), b"abc"),
        (TensorSpec("empty1", "bfloat16", (4, 0)), b""),
        (TensorSpec("b", "int64", (2,)), bytes(range(16))),
        (TensorSpec("empty2", "int8", (0, 0, 0)), b""),
    ]
    blob = seal_object(_kv_key(), Provenance("r"), tensors, keyring=HMAC, state_id=new_state_id(), version=1)
    opened = open_sealed(blob, Expectation.for_key(_kv_key(), tensors=tuple(s for s, _ in tensors)), HMAC)
    assert [(s, bytes(v)) for s, v in opened.tensor_views()] == tensors
    assert [t.offset for t in opened.header.tensors] == [0, 0, 64, 64, 128]
    assert opened.header.payload_len == 128


def test_multi_tensor_payload_is_64_byte_aligned():
    specs = [TensorSpec("conv", "bfloat16", (3, 5)), TensorSpec("ssm", "float32", (5, 3)), TensorSpec("x", "bool", (1,))]
    layout = layout_payload(specs)
    assert layout.offsets == (0, 64, 128)
    assert layout.regions == (64, 64, 1)
    assert layout.payload_len == 129


def test_seal_digests_the_payload_in_place_without_copying():
    specs = [TensorSpec("conv", "bfloat16", (3, 8)), TensorSpec("ssm", "float32", (8, 2))]
    layout = layout_payload(specs)
    payload = bytearray(random.Random(1).randbytes(layout.payload_len))
    header = seal(_kv_key(), Provenance("r", 3), layout, payload, keyring=HMAC, state_id=new_state_id(), version=2)
    opened = open_sealed(bytes(header) + bytes(payload), None, HMAC)
    assert bytes(opened.payload) == bytes(payload)
    # the object can also be verified from two separate buffers (header, payload)
    verify_payload_only(opened.header, payload, HMAC)


def test_seal_refuses_a_state_id_that_is_not_16_bytes():
    # regression: struct zero-padded a short state_id, so the stored object carried an id
    # different from the one the producer held.
    for bad in (b"short", bytes(17), "0" * 16):
        with pytest.raises(InvalidRequest):
            seal_object(_kv_key(), Provenance("r"), [], keyring=HMAC, state_id=bad, version=1)


@pytest.mark.parametrize("version", [-1, 2**64, True])
def test_seal_refuses_a_version_outside_u64(version):
    # regression: used to escape as struct.error
    with pytest.raises(InvalidRequest):
        seal_object(_kv_key(), Provenance("r"), [], keyring=HMAC, state_id=new_state_id(), version=version)


def test_tensor_shape_dims_must_fit_u64():
    # regression: a zero-size tensor with a dim ≥ 2**64 escaped seal() as struct.error
    with pytest.raises(InvalidRequest):
        TensorSpec("t", "uint8", (0, 2**64))


def test_seal_refuses_a_payload_of_the_wrong_size():
    spec = TensorSpec("t", "float32", (4,))
    with pytest.raises(InvalidRequest):
        seal_object(_kv_key(), Provenance("r"), [(spec, bytes(15))], keyring=HMAC, state_id=new_state_id(), version=1)
    with pytest.raises(InvalidRequest):
        seal(_kv_key(), Provenance("r"), layout_payload([spec]), bytes(17), keyring=HMAC,
             state_id=new_state_id(), version=1)


def test_a_worker_without_any_key_verifies_the_payload_where_it_landed():
    # format 2 binds unkeyed digests: the header is checked by the daemon, the payload by
    # whoever holds the bytes, with no key (a worker holding the key could forge objects)
    keyring = Keyring.generate()
    spec = TensorSpec("t", "uint8", (4,))
    blob = seal_object(_kv_key(), Provenance("r"), [(spec, b"abcd")], keyring=keyring,
                       state_id=new_state_id(), version=1)
    header = parse_header(blob[: decode_header(blob).header_len])
    landed = bytearray(blob[header.header_len :])
    verify_payload_only(header, landed)
    landed[2] ^= 1
    with pytest.raises(CorruptPayload, match="digest mismatch"):
        verify_payload_only(header, landed)


# ------------------------------------------------------------------ documented byte layout

_TYPES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q"}


def _doc_table() -> list[tuple[int, int, str, str]]:
    text = DOC.read_text()
    section = text.split("<!-- header-table:begin -->")[1].split("<!-- header-table:end -->")[0]
    rows = []
    for line in section.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*`?([\w\[\]]+)`?\s*\|\s*`(\w+)`", line)
        if m:
            rows.append((int(m[1]), int(m[2]), m[3], m[4]))
    return rows


def _read(view: bytes, offset: int, size: int, typ: str):
    if typ in _TYPES:
        (value,) = struct.unpack_from("<" + _TYPES[typ], view, offset)
        assert struct.calcsize(_TYPES[typ]) == size
        return value
    assert typ == f"bytes[{size}]"
    return view[offset : offset + size]


def test_documented_fixed_header_table_tiles_232_bytes():
    rows = _doc_table()
    assert rows, "docs/protocol.md lost its header table markers"
    cursor = 0
    for offset, size, _typ, name in rows:
        assert offset == cursor, f"{name} documented at {offset}, expected {cursor}"
        cursor += size
    assert cursor == FIXED_BYTES == 232


@pytest.mark.parametrize("sig_alg", list(SigAlg), ids=lambda a: a.label)
def test_documented_offsets_read_a_real_header(sig_alg):
    keyring = KEYRINGS[sig_alg]
    key = _kv_key(group_layers=(5, 9, 13), shard=3)
    prov = Provenance("req-é", 11, "prefill-0", 1_700_000_000_123_456_789)
    tensors = [(TensorSpec("k", "bfloat16", (2, 3)), bytes(range(12))),
               (TensorSpec("v", "float32", (3,)), bytes(range(12)))]
    state_id = new_state_id()
    blob = seal_object(key, prov, tensors, keyring=keyring, state_id=state_id, version=4,
                       digest_alg=DigestAlg.XXH3_128, contains_speculative=True)
    header = decode_header(blob)
    fields = {name: _read(blob, off, size, typ) for off, size, typ, name in _doc_table()}
    expected = {
        "magic": MAGIC, "format_version": 3, "sig_alg": int(sig_alg), "digest_alg": 2,
        "header_len": header.header_len, "reserved0": 0, "payload_len": header.payload_len,
        "key_id": keyring.active.key_id, "kind": 1, "flags": FLAG_SEALED | FLAG_SPECULATIVE, "shard": 3,
        "layer": 5, "namespace": NS.digest, "prefix_hash": key.prefix_hash, "token_start": 16,
        "token_end": 32, "step": 11, "created_at_ns": prov.created_at_ns, "state_id": state_id,
        "version": 4, "fingerprint": fingerprint(key, "req-é", 11), "payload_digest": header.payload_digest,
        "n_group_layers": 3, "n_tensors": 2, "request_id_len": len("req-é".encode()),
        "producer_id_len": 9, "reserved1": 0,
    }
    assert fields == expected

    # the variable part, walked as the doc describes it
    pos = FIXED_BYTES
    assert struct.unpack_from("<3I", blob, pos) == (5, 9, 13)
    pos += 12
    assert blob[pos : pos + fields["request_id_len"]].decode() == "req-é"
    pos += fields["request_id_len"]
    assert blob[pos : pos + 9] == b"prefill-0"
    pos += 9
    for (spec, _), want_offset, want_region in zip(tensors, (0, 64), (64, 12)):
        name_len = blob[pos]
        assert blob[pos + 1 : pos + 1 + name_len].decode() == spec.name
        pos += 1 + name_len
        code, ndim = blob[pos], blob[pos + 1]
        assert code == dtypes.dtype_code(spec.dtype) and ndim == len(spec.shape)
        assert struct.unpack_from(f"<{ndim}Q", blob, pos + 2) == spec.shape
        pos += 2 + 8 * ndim
        offset, region, digest = struct.unpack_from("<QQ32s", blob, pos)
        assert (offset, region) == (want_offset, want_region)
        assert digest[16:] == bytes(16)  # xxh3-128 fills the first 16 of 32 bytes
        pos += 48
    sig_len = 32 if sig_alg is SigAlg.HMAC_SHA256 else 64
    end = header.header_len
    assert blob[pos : end - sig_len] == bytes(end - sig_len - pos)  # zero padding
    assert end % 64 == 0 and end - sig_len - pos < 64
    assert keyring.active.verify(blob[: end - sig_len], blob[end - sig_len : end])


@pytest.mark.parametrize("digest_alg", list(DigestAlg), ids=lambda a: a.label)
@pytest.mark.parametrize("sig_alg", list(SigAlg), ids=lambda a: a.label)
def test_digests_follow_the_documented_formula(sig_alg, digest_alg):
    import blake3
    import xxhash

    keyring = KEYRINGS[sig_alg]

    def d(data: bytes) -> bytes:  # unkeyed: a worker without the signing key recomputes them
        if digest_alg is DigestAlg.BLAKE3:
            return blake3.blake3(data).digest()
        return xxhash.xxh3_128_intdigest(data).to_bytes(16, "big") + bytes(16)

    tensors = [(TensorSpec("conv", "bfloat16", (3, 7)), bytes(range(42))),
               (TensorSpec("ssm", "float32", (7, 2)), bytes(range(100, 156)))]
    blob = seal_object(_kv_key(), Provenance("r"), tensors, keyring=keyring, state_id=new_state_id(),
                       version=1, digest_alg=digest_alg)
    header = decode_header(blob)
    payload = blob[header.header_len :]
    regions = [payload[0:64], payload[64:120]]
    assert payload[42:64] == bytes(22)  # alignment padding is zero and belongs to region 0
    assert [t.digest for t in header.tensors] == [d(r) for r in regions]
    assert header.payload_digest == d(struct.pack("<Q", 120) + b"".join(d(r) for r in regions))
