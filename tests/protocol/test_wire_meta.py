"""The hot ops' binary meta (``protocol/wire_meta.py``): typed, checked, fuzzed.

Every request and reply Struct round-trips through MessagePack inside a real frame; the
identity values convert both ways exactly; and no byte string or MessagePack value fed to
a request decoder raises anything but ``InvalidRequest`` (the frame was well formed, so
the daemon answers it and the connection goes on), nor to a reply decoder anything but
``MalformedFrame``.
"""

from __future__ import annotations

import os

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import InvalidRequest, MalformedFrame, StatetierError
from statetier.protocol.frames import FLAG_BINARY, Frame, FrameDecoder, Op, encode_frame_bytes
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, StateRef
from statetier.protocol.wire_meta import (
    REQUESTS,
    ErrorInfo,
    Key,
    LoadAnswer,
    LoadBatchMeta,
    LoadBatchReply,
    LoadMeta,
    LookupMeta,
    LookupReply,
    Origin,
    PutAnswer,
    PutBatchMeta,
    PutBatchReply,
    PutMeta,
    ReleaseMeta,
    ReleaseReply,
    decode,
    decode_reply,
    encode,
    key_of,
    provenance_of,
    ref_of,
    specs_of,
    wire_key,
    wire_provenance,
    wire_ref,
    wire_specs,
)

NS = NamespaceSpec("wire-meta").namespace()
KEY = StateKey(NS, Kind.KV, 7, os.urandom(32), 256, 512, 1, (7, 15, 23))
REF = StateRef(KEY, "request-1", 3, os.urandom(16), 2)
SPECS = (TensorSpec("7.k", "bfloat16", (8, 16, 128)), TensorSpec("7.v", "bfloat16", (8, 16, 128)))
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REQUEST_EXAMPLES = [
    PutMeta(wire_key(KEY), wire_provenance(Provenance("r", 1, "p", 9)), wire_specs(SPECS), publish=True, version=4,
            window=4096, trace=True, free_regions=(1, 2)),
    PutBatchMeta((PutMeta(wire_key(KEY), Origin("r"), wire_specs(SPECS), data_len=10),)),
    LoadMeta(NS.digest, ref=wire_ref(REF), tensors=wire_specs(SPECS), shm=True, layers=(15,)),
    LoadBatchMeta(NS.digest, (LoadMeta(ref=wire_ref(REF)), LoadMeta(key=wire_key(KEY), recheck=True))),
    LookupMeta(NS.digest, ((256, os.urandom(32)), (512, os.urandom(32))), (1, 2), (3,), (("kv", 0, (7, 15)),),
               "prefix", 2, False, group_shards=(1,)),
    ReleaseMeta((5, 6), (7,)),
]
REPLY_EXAMPLES = [
    PutAnswer(wire_ref(REF), "host", True, False),
    PutBatchReply((PutAnswer(wire_ref(REF), "disk"), PutAnswer(error=ErrorInfo(105, "no", "placement")),
                   PutAnswer(skipped=True))),
    LoadAnswer("host", 0, 4096, 8192, 3, trace={"daemon": 12.5}),
    LoadBatchReply((LoadAnswer("host", 0, 10), LoadAnswer(retry=True))),
    LookupReply(512, ((wire_ref(REF), 9), (wire_ref(REF), None))),
    ReleaseReply(2),
]


@pytest.mark.parametrize("meta", REQUEST_EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_request_round_trips_in_a_binary_frame(meta):
    (frame,) = FrameDecoder().feed(encode_frame_bytes(Frame(Op.PUT, 1, meta)))
    assert frame.is_binary and frame.flags == FLAG_BINARY
    assert decode(type(meta), frame.meta) == meta


@pytest.mark.parametrize("meta", REPLY_EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_reply_round_trips(meta):
    assert decode_reply(type(meta), encode(meta)) == meta


def test_identity_values_convert_both_ways_exactly():
    assert key_of(wire_key(KEY)) == KEY
    assert ref_of(wire_ref(REF)) == REF
    assert specs_of(wire_specs(SPECS)) == SPECS
    prov = Provenance("r", 3, "prod", 12345)
    assert provenance_of(wire_provenance(prov)) == prov


def test_fields_are_positional_and_trailing_defaults_may_be_left_off():
    assert msgspec.msgpack.decode(encode(ReleaseMeta((5,)))) == [[5], [], False, []]
    assert decode(LoadMeta, msgspec.msgpack.encode([NS.digest])) == LoadMeta(NS.digest)
    assert decode(ReleaseMeta, msgspec.msgpack.encode([])) == ReleaseMeta()


def test_a_lookups_group_shards_ride_at_the_end_and_peers_without_them_still_decode():
    meta = LookupMeta(NS.digest, ((256, bytes(32)),), groups=(("ssm", 0, (1, 3)),), tp_size=2, group_shards=(1,))
    older = msgspec.msgpack.decode(encode(meta))[:-1]  # what a peer sends that has no group_shards
    assert decode(LookupMeta, msgspec.msgpack.encode(older)) == msgspec.structs.replace(meta, group_shards=())

    class OlderLookupMeta(msgspec.Struct, array_like=True):  # a daemon that has no group_shards: it ignores them
        ns: bytes
        boundaries: tuple
        attention_layers: tuple = ()
        ssm_layers: tuple = ()
        groups: tuple = ()
        kv_layout: str = "blocks"
        tp_size: int = 1
        lease: bool = True
        trace: bool = False
        free_regions: tuple = ()

    assert msgspec.msgpack.decode(encode(meta), type=OlderLookupMeta).tp_size == 2


@pytest.mark.parametrize("raw, field", [
    (msgspec.msgpack.encode([b"short", [1]]), "$[0]"),  # a 5-byte namespace
    (msgspec.msgpack.encode([NS.digest, [[16, b"x" * 31]]]), "$[1][0][1]"),  # a 31-byte prefix hash
    (msgspec.msgpack.encode([NS.digest, [[-1, bytes(32)]]]), "$[1][0][0]"),  # a negative token end
    (msgspec.msgpack.encode([NS.digest, [], [], [], [], "blocks", 5000]), "$[6]"),  # tp_size past 4096
    (msgspec.msgpack.encode([NS.digest, [], [], [], [], "blocks", 2, True, False, [], [0]]), "$[10][0]"),  # no shard
])
def test_a_bad_field_is_an_invalid_request_naming_its_place(raw, field):
    with pytest.raises(InvalidRequest) as info:
        decode(LookupMeta, raw)
    assert field in info.value.message


def test_a_bad_identity_value_is_an_invalid_request():
    bad = wire_key(KEY)
    bad.start, bad.end = 512, 256  # a span that ends before it starts
    with pytest.raises(InvalidRequest, match="token_end"):
        key_of(bad)
    with pytest.raises(InvalidRequest):
        specs_of(wire_specs(SPECS)[:1] + (wire_specs(SPECS)[0].__class__("x", "no-such-dtype", (1,)),))


def test_a_layout_is_checked_once_and_a_bad_one_is_refused_every_time():
    first, again = specs_of(wire_specs(SPECS)), specs_of(wire_specs(SPECS))
    assert again == SPECS and all(a is b for a, b in zip(first, again))  # one check for a batch's layout
    bad = (wire_specs(SPECS)[0].__class__("x", "no-such-dtype", (1,)),)
    for _ in range(2):
        with pytest.raises(InvalidRequest):
            specs_of(bad)


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=40)
    | st.binary(max_size=70),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=40,
)


@FUZZ
@given(raw=st.binary(max_size=300))
def test_random_bytes_are_only_ever_an_invalid_request(raw):
    for cls in REQUESTS.values():
        try:
            decode(cls, raw)
        except InvalidRequest:
            pass
        try:
            key_of(decode(Key, raw))
        except InvalidRequest:
            pass


@FUZZ
@given(value=_values, index=st.integers(0, len(REQUEST_EXAMPLES) - 1), at=st.integers(0, 12))
def test_a_request_with_any_field_bent_decodes_or_is_an_invalid_request(value, index, at):
    meta = REQUEST_EXAMPLES[index]
    fields = msgspec.to_builtins(meta, builtin_types=(bytes,))
    fields[min(at, len(fields) - 1)] = value
    try:
        decoded = decode(type(meta), msgspec.msgpack.encode(fields))
    except InvalidRequest:
        return
    for name in ("key", "ref"):  # what decoded still has to build identity values
        found = getattr(decoded, name, None)
        if found is not None:
            try:
                (key_of if name == "key" else ref_of)(found)
            except StatetierError as exc:
                assert isinstance(exc, InvalidRequest), exc


@FUZZ
@given(raw=st.binary(max_size=300))
def test_a_reply_that_is_not_one_is_malformed(raw):
    for cls in (PutAnswer, PutBatchReply, LoadAnswer, LoadBatchReply, LookupReply, ReleaseReply):
        try:
            decode_reply(cls, raw)
        except MalformedFrame:
            pass
