"""PUT and PUT_BATCH: wire meta to one ``Engine.put_batch`` call and back (DESIGN §7).

- ``handle_put`` — one put, a batch of one: inline (``data`` is the payload) or from the
  connection's put window (``window``: its offset).
- ``handle_put_batch`` — ``items`` are PUT metas, each from the put window (``window``) or
  inline (``data_len`` bytes of ``data``, in item order). The items are decoded once, up to
  the first that does not decode, and put as one batch (``daemon.engine.puts``); each is
  answered ``{ref, tier, published, durable}``, ``{error: {code, message, reason}}``, or
  ``{skipped: true}`` after the first failure (not attempted, as a caller raising the
  first error would have cancelled them).

The inline bytes are held under the byte budget while the batch runs.
"""

from __future__ import annotations

from statetier.daemon.requests import Incoming, PutRequest, PutResult
from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.frames import Frame, Op, error_frame
from statetier.protocol.messages import field, key_from_wire, provenance_from_wire, ref_to_wire, specs_from_wire
from statetier.protocol.sealed import DigestAlg, layout_payload

from .handlers import Reply, Session, kind_of

_DIGESTS = {"blake3": DigestAlg.BLAKE3, "xxh3-128": DigestAlg.XXH3_128}


async def handle_put(session: Session, frame: Frame) -> Reply:
    inline = "window" not in frame.meta
    item = incoming(session, frame.meta, memoryview(frame.data).cast("B") if inline else None)
    async with session.budget.hold(item.payload.nbytes):
        (answer,) = await session.engine.put_batch([item])
    if isinstance(answer, StatetierError):
        raise answer
    return Reply(put_reply(answer), kind=kind_of(item.req.key))


async def handle_put_batch(session: Session, frame: Frame) -> Reply:
    items = field(frame.meta, "items", list)
    data = memoryview(frame.data).cast("B")
    batch: list[Incoming] = []
    refused: StatetierError | None = None
    cursor = 0
    for meta in items:
        try:
            if not isinstance(meta, dict):
                raise InvalidRequest("each PUT_BATCH item must be an object")
            length = field(meta, "data_len", int, optional=True)
            payload = None
            if length is not None:
                if length < 0 or cursor + length > data.nbytes:
                    raise InvalidRequest("PUT_BATCH item data_len runs past the frame's data")
                payload, cursor = data[cursor : cursor + length], cursor + length
            batch.append(incoming(session, meta, payload))
        except StatetierError as exc:
            refused = exc
            break
    async with session.budget.hold(data.nbytes):
        results = await session.engine.put_batch(batch)
    answers: list[dict] = [_answer(result) for result in results]
    if refused is not None:
        answers.append({"error": error_frame(0, refused).meta})
    answers += [{"skipped": True}] * (len(items) - len(answers))
    counted = [(kind_of(item.req.key), "put") for item, result in zip(batch, results) if isinstance(result, PutResult)]
    return Reply({"items": answers}, items=counted)


def incoming(session: Session, meta: dict, payload: memoryview | None) -> Incoming:
    """One PUT meta as the engine's ``Incoming``: inline ``payload``, or its put-window range."""
    request = put_request(session.tenant, meta)
    if payload is not None:
        return Incoming(request, payload)
    window = field(meta, "window", int)
    if session.windows is None:
        raise InvalidRequest("a PUT from a window needs the shared-memory windows of HELLO_OK")
    return Incoming(request, session.windows.put_view(window, layout_payload(request.specs).payload_len), shared=True)


def put_request(tenant: str, meta: dict) -> PutRequest:
    digest = field(meta, "digest", str, default="blake3")
    if digest not in _DIGESTS:
        raise InvalidRequest(f"field 'digest' must be one of {sorted(_DIGESTS)}")
    return PutRequest(
        tenant=tenant,
        key=key_from_wire(field(meta, "key", dict)),
        provenance=provenance_from_wire(field(meta, "provenance", dict)),
        specs=specs_from_wire(field(meta, "tensors", list)),
        publish=field(meta, "publish", bool, default=False),
        version=field(meta, "version", int, optional=True),
        speculative=field(meta, "speculative", bool, default=False),
        digest_alg=_DIGESTS[digest],
        durable=field(meta, "durable", bool, default=False),
    )


def put_reply(result: PutResult) -> dict:
    return {"ref": ref_to_wire(result.ref), "tier": result.tier, "published": result.published,
            "durable": result.durable}


def _answer(result: PutResult | StatetierError | None) -> dict:
    if isinstance(result, PutResult):
        return put_reply(result)
    if isinstance(result, StatetierError):
        return {"error": error_frame(0, result).meta}
    return {"skipped": True}
