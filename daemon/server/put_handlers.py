"""PUT and PUT_BATCH: typed meta to one ``Engine.put_batch`` call and back (DESIGN §7).

- ``handle_put(session, meta, data)`` — one put (``wire_meta.PutMeta``), a batch of one:
  inline (``data`` is the payload) or from the connection's put window (``window``).
- ``handle_put_batch(session, meta, data)`` — ``PutBatchMeta.items``, each from the put
  window or inline (``data_len`` bytes of ``data``, in item order). The items are turned
  into requests once, up to the first that is not one, and put as one batch
  (``daemon.engine.puts``); each is answered with a ``PutAnswer``: its ref, tier,
  published, durable; its ``error``; or ``skipped`` after the first failure (not
  attempted, as a caller raising the first error would have cancelled them).

The inline bytes are held under the byte budget while the batch runs. A put from the window
carries its regions' digests (``digests``, taken by the client as it copied them there):
the daemon copies the bytes into its own memory and seals over those digests without
hashing them again (docs/protocol.md §6.1: a lying client makes an object every load refuses).
"""

from __future__ import annotations

from statetier.daemon.requests import Incoming, PutRequest, PutResult
from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.frames import FrameData
from statetier.protocol.sealed import DigestAlg, layout_payload
from statetier.protocol.wire_meta import (
    ErrorInfo,
    PutAnswer,
    PutBatchMeta,
    PutBatchReply,
    PutMeta,
    key_of,
    provenance_of,
    specs_of,
    wire_ref,
)

from .handlers import Reply, Session, kind_of

_DIGESTS = {"blake3": DigestAlg.BLAKE3, "xxh3-128": DigestAlg.XXH3_128}


async def handle_put(session: Session, meta: PutMeta, data: FrameData) -> Reply:
    item = incoming(session, meta, memoryview(data).cast("B") if meta.window is None else None)
    async with session.budget.hold(item.payload.nbytes):
        (answer,) = await session.engine.put_batch([item])
    if isinstance(answer, StatetierError):
        raise answer
    assert answer is not None  # None only for an item after a failed one: this batch has one
    return Reply(put_answer(answer), kind=kind_of(item.req.key))


async def handle_put_batch(session: Session, meta: PutBatchMeta, data: FrameData) -> Reply:
    data = memoryview(data).cast("B")
    batch: list[Incoming] = []
    refused: StatetierError | None = None
    cursor = 0
    for item in meta.items:
        try:
            payload = None
            if item.data_len is not None:
                if cursor + item.data_len > data.nbytes:
                    raise InvalidRequest("PUT_BATCH item data_len runs past the frame's data")
                payload, cursor = data[cursor : cursor + item.data_len], cursor + item.data_len
            batch.append(incoming(session, item, payload))
        except StatetierError as exc:
            refused = exc
            break
    async with session.budget.hold(data.nbytes):
        results = await session.engine.put_batch(batch)
    answers = [_answer(result) for result in results]
    if refused is not None:
        answers.append(PutAnswer(error=ErrorInfo.of(refused)))
    answers += [PutAnswer(skipped=True)] * (len(meta.items) - len(answers))
    counted = [(kind_of(item.req.key), "put") for item, result in zip(batch, results) if isinstance(result, PutResult)]
    return Reply(PutBatchReply(tuple(answers)), items=counted)


def incoming(session: Session, meta: PutMeta, payload: memoryview | None) -> Incoming:
    """One put as the engine's ``Incoming``: inline ``payload``, or its put-window range."""
    request = put_request(session.tenant, meta)
    if payload is not None:
        if meta.digests is not None:
            raise InvalidRequest("digests come with a put from the put window (window), not inline")
        return Incoming(request, payload)
    if meta.window is None:
        raise InvalidRequest("a PUT_BATCH item is from the put window (window) or inline (data_len)")
    if session.windows is None:
        raise InvalidRequest("a PUT from a window needs the shared-memory windows of HELLO_OK")
    nbytes = layout_payload(request.specs).payload_len
    return Incoming(request, session.windows.put_view(meta.window, nbytes), shared=True, digests=meta.digests)


def put_request(tenant: str, meta: PutMeta) -> PutRequest:
    digest = _DIGESTS.get(meta.digest)
    if digest is None:
        raise InvalidRequest(f"field 'digest' must be one of {sorted(_DIGESTS)}")
    return PutRequest(tenant=tenant, key=key_of(meta.key), provenance=provenance_of(meta.provenance),
                      specs=specs_of(meta.tensors), publish=meta.publish, version=meta.version,
                      speculative=meta.speculative, digest_alg=digest, durable=meta.durable, tag=meta.tag)


def put_answer(result: PutResult) -> PutAnswer:
    return PutAnswer(wire_ref(result.ref), result.tier, result.published, result.durable)


def _answer(result: PutResult | StatetierError | None) -> PutAnswer:
    if isinstance(result, PutResult):
        return put_answer(result)
    if isinstance(result, StatetierError):
        return PutAnswer(error=ErrorInfo.of(result))
    return PutAnswer(skipped=True)
