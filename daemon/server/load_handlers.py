"""LOAD and LOAD_BATCH: wire meta to one ``Engine.load_batch`` call, the payloads to the client.

- ``handle_load`` — one load, a batch of one: the stored object's signed header and its
  payload, either both in ``data`` (inline: a whole object's leased bytes are sent without
  a copy, the lease released once the transport let go of them) or, when the client asked
  for its window (``shm``), the header in ``data`` and the payload copied into a region of
  the connection's load window (inline, copied, when the window has no room).
- ``handle_load_batch`` — ``items`` are LOAD metas without ``ns`` and ``shm`` (given once).
  The items are decoded once, loaded as one batch, every payload copied (into its window
  region, or into the reply) in one job (``protocol.thresholds.run_work``), and every lease
  given back at once. Each item is answered ``{tier, at, len}`` plus ``window`` and
  ``region`` when its payload went to the window, ``{retry: true}`` when neither the window
  nor this reply had room for it (the client loads it alone), ``{error: …}``, or
  ``{skipped: true}`` after the first failure; ``data[at:at+len]`` is the item's header
  (window) or its header and payload (inline).
- ``load_request(tenant, meta)`` — one LOAD meta as a ``LoadRequest``; ``chosen_regions`` —
  the payload regions a load sends (a group object's chosen ``layers`` only).

The daemon has checked each header (signature, identity, version); the client checks the
payload against the header's digests where it lands (DESIGN §6).
"""

from __future__ import annotations

from statetier.daemon.requests import LoadRequest, LoadResult
from statetier.daemon.trace import phase
from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.frames import Frame, error_frame
from statetier.protocol.groups import check_layers, chosen
from statetier.protocol.messages import field, key_from_wire, ref_from_wire, specs_from_wire
from statetier.protocol.thresholds import run_work

from .handlers import Reply, Session, int_list, kind_of, namespace_of


async def handle_load(session: Session, frame: Frame) -> Reply:
    request = load_request(session.tenant, frame.meta)
    wants_shm = field(frame.meta, "shm", bool, default=False) and session.windows is not None
    engine, owner = session.engine, session.owner
    (result,) = await engine.load_batch([request], owner)
    if isinstance(result, StatetierError):
        raise result
    meta, kind = {"tier": result.tier}, kind_of(result.header.key)
    if request.layers is None and not wants_shm:
        blob = memoryview(result.blob).cast("B")  # sent as it lies: no copy, released once sent

        async def release() -> None:
            await engine.release(result.lease_id, owner)

        return Reply(meta, blob, kind=kind, borrowed=True, hold_bytes=blob.nbytes, done=release)
    try:
        answer, data = await _copied(session, [(request, result)], wants_shm, room=None)
    finally:
        await engine.release(result.lease_id, owner)
    meta.update(answer[0])
    del meta["at"], meta["len"]
    return Reply(meta, data, kind=kind)


async def handle_load_batch(session: Session, frame: Frame) -> Reply:
    meta = frame.meta
    items = field(meta, "items", list)
    wants_shm = field(meta, "shm", bool, default=False) and session.windows is not None
    requests: list[LoadRequest] = []
    refused: StatetierError | None = None
    for item in items:
        try:
            if not isinstance(item, dict):
                raise InvalidRequest("each LOAD_BATCH item must be an object")
            requests.append(load_request(session.tenant, {**item, "ns": meta.get("ns")}))
        except StatetierError as exc:
            refused = exc
            break
    results = await session.engine.load_batch(requests, session.owner)
    loaded = [(request, result) for request, result in zip(requests, results) if isinstance(result, LoadResult)]
    try:
        copied, data = await _copied(session, loaded, wants_shm, room=session.max_frame - (1 << 20))
    finally:
        await session.engine.release_many([result.lease_id for _, result in loaded], session.owner)
    counted = [(kind_of(result.header.key), "load") for (_, result), answer in zip(loaded, copied)
               if "retry" not in answer]
    copied.reverse()
    answers: list[dict] = []
    for result in results:
        if isinstance(result, LoadResult):
            answers.append(copied.pop())
        elif isinstance(result, StatetierError):
            answers.append({"error": error_frame(0, result).meta})
        else:
            answers.append({"skipped": True})
    if refused is not None:
        answers.append({"error": error_frame(0, refused).meta})
    answers += [{"skipped": True}] * (len(items) - len(answers))
    return Reply({"items": answers}, data, items=counted)


async def _copied(session: Session, loaded: list[tuple[LoadRequest, LoadResult]], wants_shm: bool,
                  room: int | None) -> tuple[list[dict], bytes | bytearray]:
    """Every payload of ``loaded`` placed (a load-window region, else this reply's data while
    ``room`` lasts) and copied there in one job: an answer per load, and the reply's data."""
    answers, windowed, inline = [], [], []
    regions_taken: list[int] = []
    cursor = 0
    for request, result in loaded:
        header = result.blob[: result.header.header_len]
        regions = chosen_regions(result, request.layers)
        nbytes = sum(region.nbytes for region in regions)
        placed = session.windows.place(nbytes) if wants_shm else None
        answer = {"tier": result.tier}
        if placed is not None:
            region_id, offset, dest = placed
            regions_taken.append(region_id)
            windowed.append((dest, regions))
            parts = [header]
            answer.update(window=offset, region=region_id)
        elif room is not None and cursor + header.nbytes + nbytes > room:
            answers.append({"retry": True})  # no room left in this reply: load it alone
            continue
        else:
            parts = [header, *regions]
        length = sum(part.nbytes for part in parts)
        answer.update(at=cursor, len=length)
        inline.append(parts)
        cursor += length
        answers.append(answer)
    data = bytearray(cursor)
    nbytes = cursor + sum(dest.nbytes for dest, _ in windowed)
    try:
        with phase("window_copy"):
            await run_work(session.engine.executor, nbytes, lambda: _copy_all(data, inline, windowed))
    except BaseException:
        for region_id in regions_taken:
            session.windows.free(region_id)
        raise
    return answers, data


def _copy_all(data: bytearray, inline: list[list[memoryview]], windowed: list) -> None:
    view, at = memoryview(data), 0
    for parts in inline:
        for part in parts:
            view[at : at + part.nbytes] = part
            at += part.nbytes
    for dest, regions in windowed:
        at = 0
        for region in regions:
            dest[at : at + region.nbytes] = region
            at += region.nbytes


def load_request(tenant: str, meta: dict) -> LoadRequest:
    ref_meta = field(meta, "ref", dict, optional=True)
    key_meta = field(meta, "key", dict, optional=True)
    if (ref_meta is None) == (key_meta is None):
        raise InvalidRequest("LOAD needs exactly one of 'ref' and 'key'")
    tensors = field(meta, "tensors", list, optional=True)
    ref = ref_from_wire(ref_meta) if ref_meta is not None else None
    key = key_from_wire(key_meta) if key_meta is not None else None
    layers = int_list(meta, "layers") if field(meta, "layers", list, optional=True) is not None else None
    if layers is not None:
        check_layers(ref.key if ref is not None else key, layers)
    return LoadRequest(
        tenant=tenant,
        namespace=namespace_of(meta),
        ref=ref,
        key=key,
        tensors=specs_from_wire(tensors) if tensors is not None else None,
        allow_speculative=field(meta, "speculative", bool, default=False),
        full_check=field(meta, "recheck", bool, default=False),
        layers=layers,
    )


def chosen_regions(result: LoadResult, layers: tuple[int, ...] | None) -> list[memoryview]:
    """The payload regions a load sends: all of them as one view, or a group object's chosen
    layers' regions, in payload order (the client lays them out the same way)."""
    if layers is None:
        return [result.payload]
    return [result.payload[t.offset : t.offset + t.region] for t in chosen(result.header.tensors, layers)]
