"""The batch frames: many puts or loads in one round trip, each item answered on its own.

- ``handle_put_batch`` (``PUT_BATCH``) and ``handle_load_batch`` (``LOAD_BATCH``): items are
  the single-object metas of ``handlers.py`` (without ``ns``, given once); after the first
  failing item the rest are answered ``{skipped: true}`` (``_until_first_failure``), as a
  caller raising the first error would have cancelled them. A load batch reads the registry
  for all its loads by ref up front (``Engine.expect_refs``).

Registered in ``dispatch.HANDLERS`` like the single-object handlers.
"""

from __future__ import annotations

from collections.abc import Iterator

from statetier.daemon.requests import LoadRequest
from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.frames import Frame, Op, error_frame
from statetier.protocol.messages import field, key_from_wire

from .handlers import Reply, Session, chosen_regions, kind_of, load_request, place_in_window, put_one


async def handle_put_batch(session: Session, frame: Frame) -> Reply:
    """Many puts in one frame: ``items`` are PUT metas, each from the put window
    (``window``) or inline (``data_len`` bytes of ``data``, in item order). Each item is
    answered on its own, ``{ref, tier}`` or ``{error: {code, message, reason}}``; after the
    first failure the rest are not attempted (``{skipped: true}``), as a caller raising the
    first error would have cancelled them."""
    items = field(frame.meta, "items", list)
    data = memoryview(frame.data).cast("B")
    answers, cursor, counted = [], 0, []
    async with session.budget.hold(data.nbytes):
        for item in _until_first_failure(items, answers):
            try:
                _require_object(item, Op.PUT_BATCH)
                inline = field(item, "data_len", int, optional=True)
                payload = None
                if inline is not None:
                    if inline < 0 or cursor + inline > data.nbytes:
                        raise InvalidRequest("PUT_BATCH item data_len runs past the frame's data")
                    payload, cursor = data[cursor : cursor + inline], cursor + inline
                answers.append(await put_one(session, item, payload))
                counted.append((kind_of(key_from_wire(item["key"])), "put"))
            except StatetierError as exc:
                answers.append({"error": error_frame(0, exc).meta})
    return Reply({"items": answers}, items=counted)


def _until_first_failure(items: list, answers: list[dict]) -> Iterator[object]:
    """A batch's items, each yielded once the one before it has its answer; after an
    ``error`` answer the rest are answered ``{skipped: true}`` instead, as a caller raising
    the first error would have cancelled them."""
    for item in items:
        if answers and ("error" in answers[-1] or "skipped" in answers[-1]):
            answers.append({"skipped": True})
            continue
        yield item


def _require_object(item: object, op: Op) -> None:
    if not isinstance(item, dict):
        raise InvalidRequest(f"each {op.name} item must be an object")


async def handle_load_batch(session: Session, frame: Frame) -> Reply:
    """Many loads in one frame: ``items`` are LOAD metas without ``ns`` and ``shm`` (given
    once for all). Each answer is ``{tier, at, len}`` plus ``window`` and ``region`` when
    its payload went to the load window, ``{error: {...}}``, or ``{retry: true}`` when
    neither the window nor this reply had room left for it (the client loads it alone),
    or ``{skipped: true}`` after the first failure (the rest are not attempted);
    ``data[at:at+len]`` is the item's signed header (window) or whole sealed object."""
    meta = frame.meta
    items = field(meta, "items", list)
    wants_shm = field(meta, "shm", bool, default=False) and session.windows is not None
    engine, owner = session.engine, session.owner
    answers, parts, cursor, counted = [], [], 0, []
    room = session.max_frame - (1 << 20)  # meta and frame header fit in the rest
    requests = _load_requests(session.tenant, items, meta.get("ns"))
    expected = await engine.expect_refs([r for r in requests if not isinstance(r, StatetierError)])
    expected += [None] * (len(requests) - len(expected))
    for request, found in _until_first_failure(list(zip(requests, expected)), answers):
        try:
            if isinstance(request, StatetierError):
                raise request
            if isinstance(found, StatetierError):
                raise found
            result = await engine.load(request, owner, expected=found)
            try:
                answer = {"tier": result.tier}
                regions = chosen_regions(result, request.layers)
                placed = await place_in_window(session, regions) if wants_shm else None
                if placed is not None:
                    part = bytes(result.blob[: result.header.header_len])
                    answer.update(window=placed[1], region=placed[0])
                elif cursor + result.blob.nbytes > room:
                    answers.append({"retry": True})  # no room left in this reply: load it alone
                    continue
                else:
                    part = b"".join([result.blob[: result.header.header_len], *regions])
            finally:
                await engine.release(result.lease_id, owner)
            answer.update({"at": cursor, "len": len(part)})
            parts.append(part)
            cursor += len(part)
            answers.append(answer)
            counted.append((kind_of(result.header.key), "load"))
        except StatetierError as exc:
            answers.append({"error": error_frame(0, exc).meta})
    return Reply({"items": answers}, b"".join(parts), items=counted)


def _load_requests(tenant: str, items: list, ns) -> list[LoadRequest | StatetierError]:
    """The batch's items as requests, up to the first that is not one (its error ends the list)."""
    out: list[LoadRequest | StatetierError] = []
    for item in items:
        try:
            _require_object(item, Op.LOAD_BATCH)
            out.append(load_request(tenant, {**item, "ns": ns}))
        except StatetierError as exc:
            out.append(exc)
            break
    return out + [InvalidRequest("not attempted")] * (len(items) - len(out))
