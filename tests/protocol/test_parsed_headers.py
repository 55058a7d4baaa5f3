"""``ParsedHeaders``: the SDK's header cache, beside the daemon's ``VerifiedHeaders``."""

from __future__ import annotations

import pytest

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import TruncatedState
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import ParsedHeaders, parse_header, seal_object

NS = NamespaceSpec("org/parsed", kv_dtype="bfloat16").namespace()
KEYRING = Keyring.generate()


def header_of(layer: int) -> bytes:
    key = StateKey(NS, Kind.KV, layer, bytes(32), 0, 16)
    blob = seal_object(key, Provenance("r", 0, "p", 1), [(TensorSpec("k", "bfloat16", (4, 4)), bytes(32))],
                       keyring=KEYRING, state_id=bytes([layer + 1]) * 16, version=1)
    return blob[: int.from_bytes(blob[8:12], "little")]


def test_a_header_is_parsed_once_by_its_exact_bytes_and_the_cache_stays_bounded() -> None:
    cache = ParsedHeaders(capacity=2)
    first = header_of(0)
    parsed = cache.parse(memoryview(first))
    assert parsed == parse_header(first)
    assert cache.parse(bytearray(first)) is parsed  # a hit: the same object, not parsed again
    cache.parse(header_of(1))
    cache.parse(header_of(2))
    assert len(cache) == 2
    assert cache.parse(first) is not parsed and cache.parse(first) == parsed  # evicted, parsed again


def test_bytes_that_do_not_parse_are_refused_and_not_kept() -> None:
    cache = ParsedHeaders()
    with pytest.raises(TruncatedState):
        cache.parse(header_of(0)[:-1])
    assert len(cache) == 0
