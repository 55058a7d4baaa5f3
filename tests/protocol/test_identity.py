"""Identity: namespace digests, StateKey encoding, fingerprints, stream ids, prefix hashes.

The pinned hex values below were computed once; if one changes, every stored object and
every peer on another machine stops matching — that is a format break, not a test to update.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import (EMPTY_PREFIX, Kind, Namespace, NamespaceSpec, Provenance, StateKey, StateRef,
                                         fingerprint, new_state_id, prefix_hash, prefix_hashes, stream_id)

PROPS = settings(max_examples=60, deadline=None)

TOKENS = list(range(1000, 1040))  # two full blocks of 16 and a partial block of 8
PINNED_BLOCKS = [
    "c3e7af48143a95b188158f69dc28fc6d709eb8b0999cc900f9794f9cda0f0c72",
    "78ef344d408b469c1bda53713502cc4bf090065feeeb3bc373cd38bae49f5e53",
]
PINNED_FULL = "1af65d5e21989811418c0607a0be027018c84d502fcef586b6dd4f1a10fc8b9f"
PINNED_SEED7_FIRST = "099a9079c27d7b174bd8f9c571e38f26723e2c3e8b323c4b1e01e978ab02e42a"
PINNED_NAMESPACE = "432e591b74776f255ed982f27c345ea9af276d9471c36a61532725e40ed7bef5"

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=80)
texts = st.text(max_size=40)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
digests = st.binary(min_size=32, max_size=32)


def spec_fields():
    return st.fixed_dictionaries(
        {
            "model_id": texts,
            "revision": texts,
            "weight_dtype": texts,
            "quantization": texts,
            "kv_block_size": u32,
            "kv_dtype": texts,
            "ssm_dtype": texts,
            "conv_dtype": texts,
            "conv_layout": texts,
            "tp_size": u32,
            "hash_algorithm": texts,
            "hash_seed": u64,
            "tenant": texts,
        }
    )


def _reference_chain(tokens, block_size, seed=0):
    """The chain as docs/protocol.md spells it, written independently of identity.py."""
    h = bytes(32) if seed == 0 else hashlib.blake2b(struct.pack("<Q", seed), digest_size=32).digest()
    out = []
    for start in range(0, len(tokens), block_size):
        block = tokens[start : start + block_size]
        h = hashlib.blake2b(h + struct.pack(f"<I{len(block)}I", len(block), *block), digest_size=32).digest()
        out.append(h)
    return out


# ------------------------------------------------------------------ prefix hashes


def test_prefix_hashes_are_pinned_across_machines():
    assert [h.hex() for h in prefix_hashes(TOKENS, 16)] == PINNED_BLOCKS
    assert prefix_hash(TOKENS).hex() == PINNED_FULL
    assert prefix_hashes(TOKENS, 16, include_partial=True)[-1].hex() == PINNED_FULL
    assert prefix_hashes(TOKENS, 16, seed=7)[0].hex() == PINNED_SEED7_FIRST


def test_prefix_hash_matches_the_documented_encoding():
    assert [h.hex() for h in _reference_chain(TOKENS, 16)] == PINNED_BLOCKS + [PINNED_FULL]
    assert _reference_chain(TOKENS, 16, seed=7)[0].hex() == PINNED_SEED7_FIRST


def test_extra_keys_fold_into_their_block_and_every_later_one_as_documented():
    """DESIGN §2: what else an engine folds into a block's identity is part of the prefix."""
    plain = prefix_hashes(TOKENS, 16)
    assert prefix_hashes(TOKENS, 16, extra_keys=[b"", b""]) == plain  # none: exactly as without
    salted = prefix_hashes(TOKENS, 16, extra_keys=[b"salt"])
    assert salted[0] != plain[0] and salted[1] != plain[1]  # the first block's keys change the whole chain
    later = prefix_hashes(TOKENS, 16, extra_keys=[b"", b"image"])
    assert later[0] == plain[0] and later[1] != plain[1]
    first = TOKENS[:16]
    want = hashlib.blake2b(bytes(32) + struct.pack("<I16I", 16, *first) + struct.pack("<I", 4) + b"salt",
                           digest_size=32).digest()
    assert salted[0] == want
    with pytest.raises(InvalidRequest):
        prefix_hashes(TOKENS, 16, extra_keys=["salt"])  # type: ignore[list-item]


def test_empty_prefix_is_the_seed_value():
    assert prefix_hash([]) == EMPTY_PREFIX == bytes(32)
    assert prefix_hashes([], 16) == []
    assert prefix_hashes(list(range(15)), 16) == []
    assert prefix_hash([], seed=3) == hashlib.blake2b(struct.pack("<Q", 3), digest_size=32).digest()


@PROPS
@given(tokens=token_lists, block_size=st.integers(1, 20), seed=st.sampled_from([0, 1, 2**64 - 1]))
def test_prefix_hashes_chain_block_by_block(tokens, block_size, seed):
    chain = prefix_hashes(tokens, block_size, seed=seed)
    assert len(chain) == len(tokens) // block_size
    for i, h in enumerate(chain):
        assert h == prefix_hash(tokens[: block_size * (i + 1)], block_size=block_size, seed=seed)
    with_partial = prefix_hashes(tokens, block_size, seed=seed, include_partial=True)
    assert with_partial[: len(chain)] == chain
    assert with_partial == _reference_chain(tokens, block_size, seed)
    if tokens:
        assert with_partial[-1] == prefix_hash(tokens, block_size=block_size, seed=seed)


@PROPS
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=64))
def test_prefix_hashes_chaining_with_block_16(tokens):
    chain = prefix_hashes(tokens, 16)
    for i in range(len(chain)):
        assert chain[i] == prefix_hash(tokens[: 16 * (i + 1)])


@PROPS
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40), data=st.data())
def test_prefix_hash_changes_with_any_token(tokens, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (changed[i] + 1) % 2**32
    assert prefix_hash(changed) != prefix_hash(tokens)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_ids_outside_u32_are_refused(bad):
    with pytest.raises(InvalidRequest):
        prefix_hash([1, bad])


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_prefix_hash_refuses_a_non_positive_block_size(block_size):
    # regression: a negative block_size used to hash no block at all, so every token list
    # got the empty-prefix value; zero raised a bare ValueError.
    with pytest.raises(InvalidRequest) as info:
        prefix_hash([1, 2, 3], block_size=block_size)
    assert type(info.value) is InvalidRequest
    with pytest.raises(InvalidRequest):
        prefix_hashes([1, 2, 3], block_size)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_prefix_hash_refuses_a_seed_outside_u64(seed):
    # regression: used to escape as struct.error
    with pytest.raises(InvalidRequest):
        prefix_hash([1], seed=seed)


# ------------------------------------------------------------------ namespace


def test_namespace_is_pinned():
    spec = NamespaceSpec("org/model", revision="r1", kv_dtype="bfloat16", tp_size=2)
    assert spec.namespace().hex() == PINNED_NAMESPACE


@PROPS
@given(fields=spec_fields())
def test_namespace_is_a_pure_function_of_the_spec(fields):
    a = NamespaceSpec(**fields).namespace()
    assert a == NamespaceSpec(**fields).namespace()
    assert len(a.digest) == 32
    assert Namespace.from_hex(a.hex()) == a


@PROPS
@given(fields=spec_fields(), data=st.data())
def test_every_namespace_field_changes_the_namespace(fields, data):
    name = data.draw(st.sampled_from(sorted(fields)))
    other = dict(fields)
    if isinstance(fields[name], str):
        other[name] = fields[name] + "x"
    else:
        other[name] = fields[name] + 1 if fields[name] < 2**32 - 1 else fields[name] - 1
    assert NamespaceSpec(**other).namespace() != NamespaceSpec(**fields).namespace()


def test_namespace_fields_cannot_shift_into_each_other():
    a = NamespaceSpec("ab", revision="c").namespace()
    b = NamespaceSpec("a", revision="bc").namespace()
    assert a != b


def test_namespace_text_longer_than_255_bytes_is_refused():
    with pytest.raises(InvalidRequest):
        NamespaceSpec("é" * 128).namespace()  # 256 bytes in UTF-8


@pytest.mark.parametrize("text", ["", "zz", "00" * 31, "00" * 33])
def test_namespace_from_bad_hex_is_refused(text):
    with pytest.raises(InvalidRequest):
        Namespace.from_hex(text)


# ------------------------------------------------------------------ keys, refs, digests


def keys():
    return st.builds(
        lambda ns, kind, layer, ph, start, length, shard, groups: StateKey(
            Namespace(ns), kind, layer, ph, 0 if kind is Kind.SSM else start,
            (0 if kind is Kind.SSM else start) + length, shard, tuple(groups)
        ),
        digests,
        st.sampled_from(Kind),
        u32,
        digests,
        st.integers(0, 2**63),
        st.integers(0, 2**62),
        st.integers(0, 0xFFFF),
        st.lists(u32, max_size=6),
    )


@PROPS
@given(key=keys())
def test_state_key_encoding_is_canonical(key):
    encoded = key.encode()
    n = len(key.group_layers)
    assert len(encoded) == 32 + 7 + 2 + 4 * n + 32 + 16
    assert encoded[:32] == key.namespace.digest
    assert struct.unpack_from("<BIH", encoded, 32) == (int(key.kind), key.layer, key.shard)
    assert struct.unpack_from(f"<H{n}I", encoded, 39) == (n, *key.group_layers)
    pos = 41 + 4 * n
    assert encoded[pos : pos + 32] == key.prefix_hash
    assert struct.unpack_from("<QQ", encoded, pos + 32) == (key.token_start, key.token_end)
    assert key.digest() == hashlib.blake2b(b"statetier/key/1" + encoded, digest_size=16).digest()


@PROPS
@given(key=keys(), request_id=texts, step=u64)
def test_fingerprint_and_stream_id_follow_the_documented_encoding(key, request_id, step):
    rid = request_id.encode()
    body = b"statetier/fingerprint/1" + key.encode() + struct.pack("<I", len(rid)) + rid + struct.pack("<Q", step)
    assert fingerprint(key, request_id, step) == hashlib.blake2b(body, digest_size=32).digest()
    n = len(key.group_layers)
    stream = (
        b"statetier/stream/1" + key.namespace.digest + struct.pack("<I", len(rid)) + rid
        + struct.pack("<BIH", int(key.kind), key.layer, key.shard)
        + struct.pack(f"<H{n}I", n, *key.group_layers)
        + struct.pack("<QQ", key.token_start, key.token_end)
    )
    assert stream_id(key, request_id) == hashlib.blake2b(stream, digest_size=16).digest()


def _key(**changes):
    base = dict(namespace=Namespace(bytes(range(32))), kind=Kind.KV, layer=3,
                prefix_hash=prefix_hash(TOKENS[:32]), token_start=16, token_end=32, shard=1,
                group_layers=())
    base.update(changes)
    return StateKey(**base)


@pytest.mark.parametrize(
    "change",
    [
        {"namespace": Namespace(bytes(32))},
        {"kind": Kind.SSM, "token_start": 0},
        {"layer": 4},
        {"shard": 2},
        {"group_layers": (3, 5)},
        {"prefix_hash": prefix_hash(TOKENS[:31])},
        {"token_start": 0},
        {"token_end": 33},
    ],
    ids=lambda c: "+".join(c),
)
def test_fingerprint_covers_every_key_field(change):
    assert fingerprint(_key(**change), "req", 7) != fingerprint(_key(), "req", 7)


def test_fingerprint_covers_request_and_step():
    base = fingerprint(_key(), "req", 7)
    assert fingerprint(_key(), "req2", 7) != base
    assert fingerprint(_key(), "req", 8) != base


def test_stream_id_ignores_the_prefix_hash_but_not_the_span():
    assert stream_id(_key(prefix_hash=bytes(32)), "r") == stream_id(_key(), "r")
    assert stream_id(_key(token_end=48), "r") != stream_id(_key(), "r")
    assert stream_id(_key(), "r2") != stream_id(_key(), "r")


def test_ssm_key_spans_from_zero():
    key = _key(kind="ssm", token_start=0, token_end=48)
    assert key.kind is Kind.SSM and key.tokens_absorbed == 48
    with pytest.raises(InvalidRequest):
        _key(kind=Kind.SSM, token_start=1)


@pytest.mark.parametrize(
    "change",
    [
        {"layer": -1}, {"layer": 2**32}, {"shard": 0x10000}, {"prefix_hash": bytes(31)},
        {"token_start": 40}, {"kind": "mamba"}, {"kind": 9}, {"group_layers": (2**32,)},
        {"layer": True},
    ],
    ids=str,
)
def test_state_key_refuses_out_of_range_fields(change):
    with pytest.raises(InvalidRequest):
        _key(**change)


def test_kind_parses_names_and_codes():
    assert Kind.parse("KV") is Kind.KV and Kind.parse("ssm") is Kind.SSM and Kind.parse(2) is Kind.SSM


@PROPS
@given(request_id=texts, step=u64, producer=texts, created=u64)
def test_provenance_accepts_non_ascii_text(request_id, step, producer, created):
    prov = Provenance(request_id, step, producer, created)
    assert (prov.request_id, prov.step, prov.producer_id, prov.created_at_ns) == (request_id, step, producer, created)


def test_state_ref_derives_its_fingerprint_and_stream():
    ref = StateRef(_key(), "請求-1", 4, new_state_id(), 2)
    assert ref.fingerprint == fingerprint(_key(), "請求-1", 4)
    assert ref.stream_id == stream_id(_key(), "請求-1")
    with pytest.raises(InvalidRequest):
        StateRef(_key(), "r", 0, bytes(15), 1)
    with pytest.raises(InvalidRequest):
        StateRef(_key(), "r", 0, bytes(16), 1, fingerprint=bytes(31))


def test_new_state_ids_are_random_128_bit():
    ids = {new_state_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 16 for i in ids)
