"""A torch-free client for the probes, over the SDK's frame transport (``clients.transport``).

``Wire.open(url, model=…, tenant=…, token=…, ssl=…, shm=False)``; every object is one uint8
tensor ``"kv"`` of a KV key ``(layer, prefix, [0, 16))`` in the namespace of ``model``:

- ``key(layer, prefix)``; ``put(key, data, request_id=…, durable=…, publish=…)`` → a dict
  of the reply (``ref`` as its JSON form, which the probes keep and pass between
  processes; ``tier``, ``published``, ``durable``); ``load(ref=…|key=…)`` → the payload bytes
  (inline: the reply holds the signed header, then the payload; the probes compare the
  bytes with what their put sent); ``lookup(layers, prefix, lease=…)`` → the tokens of a
  joint hit over those layers' ``[0, 16)`` objects; ``delete(ref)``; ``stats()``;
  ``request(op, meta, data)`` for anything else.

Worker processes (load, crash) import only this and ``statetier.protocol``: 64 of them cost
tens of MiB each, not a torch import each.
"""

from __future__ import annotations

import msgspec

from statetier.clients.transport import connect
from statetier.protocol.errors import CorruptPayload
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.frames import Op
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.messages import ref_from_wire, ref_to_wire
from statetier.protocol.sealed import check_payload, decode_header, layout_payload
from statetier.protocol.wire_meta import (
    LoadMeta,
    LookupMeta,
    LookupReply,
    PutAnswer,
    PutMeta,
    decode_reply,
    ref_of,
    wire_key,
    wire_provenance,
    wire_ref,
    wire_specs,
)

TOKENS = 16


class Wire:
    def __init__(self, conn, namespace) -> None:
        self.conn = conn
        self.namespace = namespace

    @classmethod
    async def open(cls, url: str, *, model: str = "chaos", shm: bool = False, timeout: float = 10.0,
                   **options) -> "Wire":
        conn = await connect(url, shm=shm, timeout=timeout, **options)
        return cls(conn, NamespaceSpec(model_id=model).namespace())

    def key(self, layer: int, prefix: bytes) -> StateKey:
        return StateKey(self.namespace, Kind.KV, layer, prefix, 0, TOKENS)

    async def put(self, key: StateKey, data: bytes, *, request_id: str, durable: bool = False,
                  publish: bool = False) -> dict:
        spec = TensorSpec("kv", "uint8", (len(data),))
        meta = PutMeta(wire_key(key), wire_provenance(Provenance(request_id)), wire_specs([spec]), publish=publish,
                       durable=durable)
        padding = layout_payload([spec]).payload_len - len(data)
        reply = await self.conn.request(Op.PUT, meta, [data, bytes(padding)] if padding else data)
        answer = decode_reply(PutAnswer, reply.meta)
        return {"ref": ref_to_wire(ref_of(answer.ref)), "tier": answer.tier, "published": answer.published,
                "durable": answer.durable}

    async def load(self, *, ref: dict | None = None, key: StateKey | None = None) -> bytes:
        """The payload, verified where it landed as every SDK load is (docs/protocol.md §6.1:
        the daemon digests no payload on a load): a damaged one is asked for once more with
        ``recheck`` (the daemon then digests what it serves and drops a damaged copy), and
        ``CorruptPayload`` is raised when that one is damaged too."""
        meta = LoadMeta(self.namespace.digest, ref=wire_ref(ref_from_wire(ref)) if ref is not None else None,
                        key=wire_key(key) if key is not None else None)
        try:
            return await self._load_verified(meta)
        except CorruptPayload:
            return await self._load_verified(msgspec.structs.replace(meta, recheck=True))

    async def _load_verified(self, meta: LoadMeta) -> bytes:
        reply = await self.conn.request(Op.LOAD, meta)
        data = memoryview(reply.data)
        header = decode_header(data)  # inline: the signed header, then the payload
        check_payload(header, data[header.header_len : header.header_len + header.payload_len])
        (tensor,) = header.tensors
        start = header.header_len + tensor.offset
        return bytes(data[start : start + tensor.nbytes])

    async def lookup(self, layers: list[int], prefix: bytes, *, lease: bool) -> int:
        meta = LookupMeta(self.namespace.digest, ((TOKENS, prefix),), tuple(layers), kv_layout="prefix", lease=lease)
        return decode_reply(LookupReply, (await self.conn.request(Op.LOOKUP, meta)).meta).tokens

    async def delete(self, ref: dict) -> int:
        return (await self.conn.request(Op.DELETE, {"ref": ref})).meta["deleted"]

    async def stats(self) -> dict:
        return (await self.conn.request(Op.STATS, {})).meta

    async def request(self, op: Op, meta: dict, data=b""):
        return await self.conn.request(op, meta, data)

    async def close(self) -> None:
        await self.conn.close()
