"""Value objects passed between the server (wire side) and the engine (tier side).

- ``PutRequest``     — what to seal: key, provenance, tensor specs, placement options, and the
                       engine's block ``tag`` its KV events carry (``daemon.events``)
- ``Incoming``       — one put of a batch: a ``PutRequest`` and its payload (bytes the daemon
                       owns, or a put-window view its client can still write: ``shared``)
- ``PutResult``      — the ``StateRef`` of the sealed object, the tier it landed in, and
                       whether it was published to the cross-node tier and whether it was
                       on a durable tier when the put was acknowledged
- ``LoadRequest``    — a load by ``StateRef`` (handoff) or by ``StateKey`` (prefix reuse),
                       always with the requester's own namespace
- ``LoadResult``     — the verified header and a payload view, leased until released
- ``LookupRequest`` / ``JointHit`` — the joint-hit query and its answer (the SDK's is ``clients.values.LookupResult``)

Frozen msgspec Structs (``LoadResult`` and ``JointHit`` are filled in, so not frozen),
not dataclasses: a batch builds several per item, and a frozen dataclass of ten fields took
µs to build where a Struct takes a fraction of one (``msgspec.structs.replace`` changes a
field). None holds a cycle: the collector never tracks them (``gc=False``).
"""

from __future__ import annotations

import msgspec

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.groups import LayerGroup
from statetier.protocol.identity import Namespace, Provenance, StateKey, StateRef
from statetier.protocol.kv_events import BlockTag
from statetier.protocol.sealed import DigestAlg, SealedHeader


class PutRequest(msgspec.Struct, frozen=True, gc=False):
    tenant: str
    key: StateKey
    provenance: Provenance
    specs: tuple[TensorSpec, ...]
    publish: bool = False
    version: int | None = None
    speculative: bool = False
    digest_alg: DigestAlg = DigestAlg.BLAKE3
    durable: bool = False  # acknowledge only once a durable tier holds the object
    tag: BlockTag | None = None  # the engine's block, named in the object's KV events


class Incoming(msgspec.Struct, frozen=True, gc=False):
    """One put of a batch: the request and its payload bytes."""

    req: PutRequest
    payload: memoryview
    shared: bool = False  # the payload lies in memory its client can still write (the put window)
    digests: tuple[bytes, ...] | None = None  # its regions' digests, taken by the client as it copied them there


class PutResult(msgspec.Struct, frozen=True, gc=False):
    ref: StateRef
    tier: str
    published: bool = False  # written through to the cross-node tier before the reply
    durable: bool = False  # a durable tier (``Tier.is_durable``) held the object before the reply


class LoadRequest(msgspec.Struct, frozen=True, gc=False):
    tenant: str
    namespace: Namespace  # the requester's own namespace, never the ref's
    ref: StateRef | None = None
    key: StateKey | None = None
    tensors: tuple[TensorSpec, ...] | None = None
    allow_speculative: bool = False
    full_check: bool = False  # digest even copies in daemon-only memory (a client's recheck)
    layers: tuple[int, ...] | None = None  # a group object's layers to send (None: all)


class LoadResult(msgspec.Struct, gc=False):
    header: SealedHeader
    payload: memoryview  # valid until the lease is released
    lease_id: int
    tier: str
    blob: memoryview  # the whole stored object, header then payload (valid like ``payload``)


class LookupRequest(msgspec.Struct, frozen=True, gc=False):
    """``boundaries``: ascending (token_end, prefix_hash) pairs of the request's prefix.

    ``kv_layout`` says how KV pages are cut: ``"blocks"`` (one page per span between
    consecutive boundaries) or ``"prefix"`` (one page per layer covering ``[0, end)``).
    ``shards``: the TP ranks that must all hold every object (``range(tp_size)`` on the wire).
    ``groups``: layer groups whose group objects must hold too (KV: one per block or one
    ``[0, end)``, as ``kv_layout`` says; SSM: one at the boundary), beside per-layer objects.
    ``group_shards``: per group, how many of ``shards`` (the first ones) hold its objects, e.g.
    1 for a state every TP rank holds the same and stores once as shard 0; empty: all of them.
    """

    tenant: str
    namespace: Namespace
    attention_layers: tuple[int, ...]
    ssm_layers: tuple[int, ...]
    boundaries: tuple[tuple[int, bytes], ...]
    kv_layout: str = "blocks"
    shards: tuple[int, ...] = (0,)
    lease: bool = True
    groups: tuple[LayerGroup, ...] = ()
    group_shards: tuple[int, ...] = ()


class JointHit(msgspec.Struct, gc=False):
    tokens: int
    objects: list[tuple[StateRef, int | None]] = msgspec.field(default_factory=list)  # (ref, lease id)
