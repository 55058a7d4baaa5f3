"""A torch-free client for the probes, over the SDK's frame transport (``clients.transport``).

``Wire.open(url, model=…, tenant=…, token=…, ssl=…, shm=False)``; every object is one uint8
tensor ``"kv"`` of a KV key ``(layer, prefix, [0, 16))`` in the namespace of ``model``:

- ``key(layer, prefix)``; ``put(key, data, request_id=…, durable=…, publish=…)`` → the
  reply meta (``ref``, ``tier``, ``published``, ``durable``); ``load(ref=…|key=…)`` → the
  payload bytes (inline: the reply holds the signed header, then the payload; the probes
  compare the bytes with what their put sent); ``delete(ref)``; ``stats()``;
  ``request(op, meta, data)`` for anything else.

Worker processes (load, crash) import only this and ``statetier.protocol``: 64 of them cost
tens of MiB each, not a torch import each.
"""

from __future__ import annotations

from statetier.clients.transport import connect
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.frames import Op
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.messages import key_to_wire, provenance_to_wire, specs_to_wire
from statetier.protocol.sealed import decode_header, layout_payload

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

    def put_meta(self, key: StateKey, size: int, request_id: str, *, durable: bool = False,
                 publish: bool = False) -> dict:
        return {"key": key_to_wire(key), "provenance": provenance_to_wire(Provenance(request_id)),
                "tensors": specs_to_wire([TensorSpec("kv", "uint8", (size,))]),
                "publish": publish, "durable": durable}

    async def put(self, key: StateKey, data: bytes, *, request_id: str, durable: bool = False,
                  publish: bool = False) -> dict:
        meta = self.put_meta(key, len(data), request_id, durable=durable, publish=publish)
        padding = layout_payload([TensorSpec("kv", "uint8", (len(data),))]).payload_len - len(data)
        reply = await self.conn.request(Op.PUT, meta, [data, bytes(padding)] if padding else data)
        return reply.meta

    async def load(self, *, ref: dict | None = None, key: StateKey | None = None) -> bytes:
        meta = {"ns": self.namespace.hex(), "shm": False}
        meta.update({"ref": ref} if ref is not None else {"key": key_to_wire(key)})
        reply = await self.conn.request(Op.LOAD, meta)
        data = memoryview(reply.data)
        header = decode_header(data)  # inline: the signed header, then the payload
        (tensor,) = header.tensors
        start = header.header_len + tensor.offset
        return bytes(data[start : start + tensor.nbytes])

    async def delete(self, ref: dict) -> int:
        return (await self.conn.request(Op.DELETE, {"ref": ref})).meta["deleted"]

    async def stats(self) -> dict:
        return (await self.conn.request(Op.STATS, {})).meta

    async def request(self, op: Op, meta: dict, data=b""):
        return await self.conn.request(op, meta, data)

    async def close(self) -> None:
        await self.conn.close()
