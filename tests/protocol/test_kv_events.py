"""protocol.kv_events: the daemon's KV event batches as vLLM's schema reads them, and back.

The decoding Structs are the tests' own, written from vLLM's published schema
(tests/daemon/kv_event_schema.py): the 0.32 form (events as tagged maps) and the earlier one
(tagged arrays). ``decode_batch`` (what the vLLM connector reads the daemon's stream with)
takes both; a put's ``BlockTag`` is bounded where the daemon decodes a PUT; a topic names the
tenant and the owned namespace, whatever the client's spec said.
"""

from __future__ import annotations

import msgspec
import pytest

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import NamespaceSpec
from statetier.protocol.kv_events import (
    MAX_TAG_HASH_BYTES,
    MAX_TAG_TOKENS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTag,
    decode_batch,
    encode_batch,
    event_topic,
)
from statetier.protocol.ownership import owned_namespace
from statetier.protocol.wire_meta import Key, Origin, PutMeta, decode, encode
from tests.support import kv_event_schema as vllm

EVENTS = [BlockStored((b"\x01" * 32,), None, (5, 6, 7), 16, "CPU"),
          BlockStored((7,), 6, (), 16, "DISK", lora_id=3),
          BlockRemoved((b"\x01" * 32,), "CPU"),
          AllBlocksCleared()]


def test_a_batch_in_the_map_form_is_what_vllm_0_32_decodes():
    batch = vllm.DECODER.decode(encode_batch(1234.5, EVENTS, "map"))
    assert batch == vllm.KVEventBatch(1234.5, [
        vllm.BlockStored([b"\x01" * 32], None, [5, 6, 7], 16, None, "CPU", None),
        vllm.BlockStored([7], 6, [], 16, 3, "DISK", None),
        vllm.BlockRemoved([b"\x01" * 32], "CPU"),
        vllm.AllBlocksCleared()])


def test_a_batch_in_the_array_form_is_what_the_earlier_schema_decodes():
    batch = vllm.ARRAY_DECODER.decode(encode_batch(1.0, EVENTS, "array"))
    assert batch == vllm.ArrayKVEventBatch(1.0, [
        vllm.ArrayBlockStored([b"\x01" * 32], None, [5, 6, 7], 16, None, "CPU"),
        vllm.ArrayBlockStored([7], 6, [], 16, 3, "DISK"),
        vllm.ArrayBlockRemoved([b"\x01" * 32], "CPU"),
        vllm.ArrayAllBlocksCleared()])


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_decode_batch_reads_either_form_back(encoding):
    assert decode_batch(encode_batch(2.5, EVENTS, encoding)) == (2.5, EVENTS)


@pytest.mark.parametrize("raw", [b"", b"\x93", msgspec.msgpack.encode([1.0, [{"type": "BlockEaten"}]]),
                                 msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]]), msgspec.msgpack.encode(7)])
def test_what_is_not_a_batch_is_an_invalid_request(raw):
    with pytest.raises(InvalidRequest):
        decode_batch(raw)


def _put_with(tag) -> bytes:
    return encode(PutMeta(Key(bytes(32), 1, 0, 0, bytes(32), 0, 16), Origin("r"), (), tag=tag))


def test_a_put_carries_its_tag_and_decodes_it_typed():
    tag = BlockTag(b"\x02" * 32, 17, tuple(range(16)))
    assert decode(PutMeta, _put_with(tag)).tag == tag
    assert decode(PutMeta, _put_with(None)).tag is None


@pytest.mark.parametrize("tag", [BlockTag(b"x" * (MAX_TAG_HASH_BYTES + 1)), BlockTag(1, b"x" * (MAX_TAG_HASH_BYTES + 1)),
                                 BlockTag(1, None, tuple(range(MAX_TAG_TOKENS + 1))), BlockTag(-1),
                                 BlockTag(1, None, (-5,)), BlockTag("text")])
def test_a_tag_past_its_bounds_is_refused_where_the_put_is_decoded(tag):
    with pytest.raises(InvalidRequest):
        decode(PutMeta, _put_with(tag))


def test_a_topic_names_the_tenant_and_the_namespace_it_owns():
    spec = NamespaceSpec(model_id="topic-model", tenant="b")  # the spec's tenant field decides nothing
    owned = owned_namespace("a", spec.namespace())
    assert event_topic("{namespace}", "a", owned.digest) == owned.hex() != spec.namespace().hex()
    assert event_topic("kv@{tenant}/{namespace}", "a", owned.digest) == f"kv@a/{owned.hex()}"
    assert event_topic("", "a", owned.digest) == ""
