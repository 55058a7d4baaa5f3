"""Each byte moved once per hop and hashed once (issue 25, item 4): passes counted, not timed.

``protocol.passes`` counts every payload byte hashed (``protocol.digests``) and every copy
from one buffer into another at the copy sites of a put and a load. A PD handoff through a
real Redis, told on two engines (prefill: host arena + Redis; decode: host arena + Redis):

- the put copies the payload once (into its arena reservation) and hashes it once (sealing);
  its publish sends the arena's bytes to Redis without another copy;
- the decode side's load copies the sealed object once (Redis chunks straight into the
  arena reservation: no join, no copy through a buffer) and hashes nothing (the client
  verifies where the bytes land); a second load, from the arena, neither copies nor hashes;
  a client's recheck digests the copy once;
- the client's landing (``clients.copies.land``) copies and hashes each payload byte once.
"""

from __future__ import annotations

import os
import uuid

import torch
from statetier.clients.copies import laid_out, land
from statetier.daemon.engine import Engine, EngineOptions, Publishing
from statetier.daemon.requests import Incoming, LoadRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import Keyring
from statetier.protocol.passes import PASSES, PassCount
from statetier.protocol.sealed import parse_header
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.registry import MemoryVersionRegistry

from tests.support.redis_tier import erase_prefix

NS = NamespaceSpec("passes").namespace()
SPECS = (TensorSpec("k", "bfloat16", (4, 8, 16, 128)), TensorSpec("v", "bfloat16", (4, 8, 16, 128)))
PAYLOAD = 2 * 4 * 8 * 16 * 128 * 2  # 256 KiB, two 64-aligned tensors: no padding


def moved(before: PassCount) -> tuple[int, int]:
    after = PASSES.snapshot()
    return after.copied - before.copied, after.hashed - before.hashed


async def node(url: str, prefix: str, keyring: Keyring, registry, name: str) -> Engine:
    host = HostTier(HostTierOptions(8 << 20, pin_memory=False))
    cross = RedisTier(RedisTierOptions(url, key_prefix=prefix), keyring=keyring)
    engine = Engine([host, cross], keyring=keyring, registry=registry, options=EngineOptions(producer_id=name),
                    arena=host, publishing=Publishing(cross, cross, marks=cross))
    await engine.start()
    return engine


async def test_a_handoff_copies_each_byte_once_per_hop_and_hashes_it_once(redis_server):
    keyring, registry, prefix = Keyring.generate(), MemoryVersionRegistry(), f"passes-{uuid.uuid4().hex[:10]}"
    prefill = await node(redis_server.url, prefix, keyring, registry, "prefill")
    decode = await node(redis_server.url, prefix, keyring, registry, "decode")
    try:
        key = StateKey(NS, Kind.KV, 0, os.urandom(32), 0, 16)
        data = os.urandom(PAYLOAD)
        before = PASSES.snapshot()
        (put,) = await prefill.put_batch([Incoming(PutRequest("default", key, Provenance("r"), SPECS, publish=True),
                                                   memoryview(data))])
        assert put.published and moved(before) == (PAYLOAD, PAYLOAD)

        before = PASSES.snapshot()
        loaded = await decode.load(LoadRequest("default", NS, ref=put.ref), owner="c")
        size = loaded.header.header_len + PAYLOAD
        assert loaded.tier == "host" and bytes(loaded.payload) == data  # promoted, read into the arena
        assert moved(before) == (size, 0)
        await decode.release(loaded.lease_id, "c")

        before = PASSES.snapshot()
        again = await decode.load(LoadRequest("default", NS, ref=put.ref), owner="c")
        assert again.tier == "host" and moved(before) == (0, 0)
        await decode.release(again.lease_id, "c")

        before = PASSES.snapshot()
        checked = await decode.load(LoadRequest("default", NS, ref=put.ref, full_check=True), owner="c")
        assert moved(before) == (0, PAYLOAD)  # a recheck digests the copy it serves
        await decode.release(checked.lease_id, "c")

        header = parse_header(bytes(checked.blob[: checked.header.header_len]))
        dests = [torch.empty(spec.shape, dtype=torch.bfloat16) for spec in SPECS]
        before = PASSES.snapshot()
        land(header, checked.payload, laid_out(header, None), dests, lambda n: torch.empty(n, dtype=torch.uint8))
        assert moved(before) == (PAYLOAD, PAYLOAD)  # the client: one copy and one hash, where it lands
        assert b"".join(d.view(torch.uint8).numpy().tobytes() for d in dests) == data
    finally:
        await prefill.close()
        await decode.close()
        erase_prefix(redis_server.url, prefix)


async def test_a_windowed_put_with_the_clients_digests_is_copied_once_and_hashed_nowhere_in_the_daemon():
    """Issue 42, item 2: the client hashed the put window's bytes as it copied them there
    (``clients.copies.fill_and_digest``: one copy, one hash) and sent the regions' digests; the
    daemon copies the window into its arena reservation once and seals over those digests."""
    from statetier.clients.copies import fill_and_digest
    from statetier.protocol.digests import DigestAlg
    from statetier.protocol.sealed import layout_payload

    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(8 << 20, pin_memory=False))
    engine = Engine([host], keyring=keyring, registry=MemoryVersionRegistry(), options=EngineOptions(producer_id="p"),
                    arena=host)
    await engine.start()
    try:
        tensors = [torch.randn(spec.shape).to(torch.bfloat16) for spec in SPECS]
        window = memoryview(bytearray(PAYLOAD))  # the put window, as the client sees it
        before = PASSES.snapshot()
        digests = fill_and_digest(window, layout_payload(SPECS), tensors, DigestAlg.BLAKE3)
        assert moved(before) == (PAYLOAD, PAYLOAD)  # the client: one copy, one hash

        key = StateKey(NS, Kind.KV, 1, os.urandom(32), 0, 16)
        before = PASSES.snapshot()
        (put,) = await engine.put_batch([Incoming(PutRequest("default", key, Provenance("r"), SPECS), window,
                                                  shared=True, digests=digests)])
        assert moved(before) == (PAYLOAD, 0)  # the daemon: one copy into its arena, no hash

        loaded = await engine.load(LoadRequest("default", NS, ref=put.ref, full_check=True), owner="c")
        assert bytes(loaded.payload) == bytes(window)  # the recheck digests it: the client's digests hold
        await engine.release(loaded.lease_id, "c")
    finally:
        await engine.close()
