"""LOAD and LOAD_BATCH: wire meta to one ``Engine.load_batch`` call, the payloads to the client.

- ``handle_load`` — one load (``wire_meta.LoadMeta``), a batch of one: the stored object's signed header and its
  payload, either both in ``data`` (inline: a whole object's leased bytes are sent without
  a copy) or, when the client asked
  for its window (``shm``), the header in ``data`` and the payload copied into a region of
  the connection's load window (inline, copied, when the window has no room).
- ``handle_load_batch`` — ``LoadBatchMeta.items`` (``ns`` and ``shm`` given once). The
  items are turned into requests once, loaded as one batch, every payload copied (into its
  window region, or into the reply) in one pass on the loop (plain copies hold the GIL
  wherever they run: ``protocol.thresholds``), and
  every lease given back at once. Each item is answered with a ``LoadAnswer``: ``tier``,
  ``at``, ``len`` (``data[at:at+len]`` is its header, or header and payload inline) plus
  ``window`` and ``region`` when its payload went to the window; ``retry`` when neither the
  window nor this reply had room for it: a batch larger than what is free takes at most
  half the window per reply (``Windows.step_bytes``), so the client asks for the next step
  as soon as this reply arrives and the daemon fills the other half while the client copies
  and verifies this one (a batch larger than the window streams through it pipelined);
  its ``error``; or ``skipped`` after the first failure.
- ``load_request(tenant, meta, namespace)`` — one ``LoadMeta`` as a ``LoadRequest``;
  ``chosen_regions`` — the payload regions a load sends (a group object's chosen ``layers``).

The daemon has checked each header (signature, identity, version); the client checks the
payload against the header's digests where it lands (DESIGN §6).
"""

from __future__ import annotations

from statetier.daemon.requests import LoadRequest, LoadResult
from statetier.daemon.trace import phase
from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.frames import FrameData
from statetier.protocol.groups import check_layers, chosen
from statetier.protocol.identity import Namespace
from statetier.protocol.passes import PASSES
from statetier.protocol.recycled import frame_buffer
from statetier.protocol.wire_meta import (
    ErrorInfo,
    LoadAnswer,
    LoadBatchMeta,
    LoadBatchReply,
    LoadMeta,
    key_of,
    ref_of,
    specs_of,
)

from .handlers import Reply, Session, kind_of


async def handle_load(session: Session, meta: LoadMeta, data: FrameData) -> Reply:
    if meta.ns is None:
        raise InvalidRequest("a LOAD names the requester's namespace (ns)")
    request = load_request(session.tenant, meta, meta.ns)
    wants_shm = meta.shm and session.windows is not None
    engine, owner = session.engine, session.owner
    (result,) = await engine.load_batch([request], owner)
    if isinstance(result, StatetierError):
        raise result
    assert result is not None  # None only for a request after a failed one: this batch has one

    async def release() -> None:  # the one place a single load's lease is given back
        await engine.release(result.lease_id, owner)

    try:
        reply = _load_reply(session, request, result, wants_shm)
    except BaseException:
        await release()  # no reply to own the lease
        raise
    reply.done = release  # the connection runs it once the reply is sent, failed or dropped
    return reply


def _load_reply(session: Session, request: LoadRequest, result: LoadResult, wants_shm: bool) -> Reply:
    """A single load's reply: the leased bytes as they lie (inline, no copy: held until sent)
    or copied (into the load window, or a group object's chosen regions inline)."""
    kind = kind_of(result.header.key)
    if request.layers is None and not wants_shm:
        blob = memoryview(result.blob).cast("B")
        return Reply(LoadAnswer(result.tier, 0, blob.nbytes), blob, kind=kind, borrowed=True, hold_bytes=blob.nbytes)
    (answer,), copied = _copied(session, [(request, result)], wants_shm, room=None)
    return Reply(answer, copied, kind=kind)


async def handle_load_batch(session: Session, meta: LoadBatchMeta, data: FrameData) -> Reply:
    wants_shm = meta.shm and session.windows is not None
    requests: list[LoadRequest] = []
    refused: StatetierError | None = None
    for item in meta.items:
        try:
            requests.append(load_request(session.tenant, item, meta.ns))
        except StatetierError as exc:
            refused = exc
            break
    results = await session.engine.load_batch(requests, session.owner)
    loaded = [(request, result) for request, result in zip(requests, results) if isinstance(result, LoadResult)]
    try:
        copied, reply_data = _copied(session, loaded, wants_shm, room=session.max_frame - (1 << 20))
    finally:
        await session.engine.release_many([result.lease_id for _, result in loaded], session.owner)
    counted = [(kind_of(result.header.key), "load") for (_, result), answer in zip(loaded, copied)
               if not answer.retry]
    copied.reverse()
    answers: list[LoadAnswer] = []
    for result in results:
        if isinstance(result, LoadResult):
            answers.append(copied.pop())
        elif isinstance(result, StatetierError):
            answers.append(LoadAnswer(error=ErrorInfo.of(result)))
        else:
            answers.append(LoadAnswer(skipped=True))
    if refused is not None:
        answers.append(LoadAnswer(error=ErrorInfo.of(refused)))
    answers += [LoadAnswer(skipped=True)] * (len(meta.items) - len(answers))
    return Reply(LoadBatchReply(tuple(answers)), reply_data, items=counted)


def _copied(session: Session, loaded: list[tuple[LoadRequest, LoadResult]], wants_shm: bool,
            room: int | None) -> tuple[list[LoadAnswer], bytearray | memoryview]:
    """Every payload of ``loaded`` placed (a load-window region, else this reply's data while
    ``room`` lasts) and copied there in one pass: an answer per load, and the reply's data."""
    answers, windowed, inline = [], [], []
    regions_taken: list[int] = []
    windows = session.windows if wants_shm else None
    chosen_all = [chosen_regions(result, request.layers) for request, result in loaded]
    sizes = [sum(region.nbytes for region in regions) for regions in chosen_all]
    share = windows.step_bytes(sizes) if windows is not None else 0  # half the window past it
    cursor = placed_bytes = 0
    for (_, result), regions, nbytes in zip(loaded, chosen_all, sizes):
        header = result.blob[: result.header.header_len]
        fits = not regions_taken or placed_bytes + nbytes <= share
        placed = windows.place(nbytes) if windows is not None and fits else None
        window = region_id = None
        if placed is not None:
            region_id, window, dest = placed
            regions_taken.append(region_id)
            placed_bytes += nbytes
            windowed.append((dest, regions))
            parts = [header]
        elif room is not None and (cursor + header.nbytes + nbytes > room
                                   or (windows is not None and nbytes <= windows.load_bytes)):
            # the window (or this reply's share of it) is full for now: the client asks
            # again, so a batch larger than the window streams through it; or this reply is
            answers.append(LoadAnswer(retry=True))
            continue
        else:
            parts = [header, *regions]
        length = sum(part.nbytes for part in parts)
        answers.append(LoadAnswer(result.tier, cursor, length, window, region_id))
        inline.append(parts)
        cursor += length
    data = frame_buffer(cursor)  # recycled when large: no page faults, no zeroing
    try:
        with phase("window_copy"):
            _copy_all(data, inline, windowed)  # no digest: on the loop (``protocol.thresholds``)
    except BaseException:
        for region_id in regions_taken:
            if windows is not None:
                windows.free(region_id)
        raise
    return answers, data


def _copy_all(data: bytearray | memoryview, inline: list[list[memoryview]], windowed: list) -> None:
    PASSES.count_copied(sum(p.nbytes for parts in inline for p in parts)
                        + sum(r.nbytes for _, regions in windowed for r in regions))
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


def load_request(tenant: str, meta: LoadMeta, namespace: bytes) -> LoadRequest:
    """One LOAD (or LOAD_BATCH item) as a ``LoadRequest`` in the requester's ``namespace``."""
    if (meta.ref is None) == (meta.key is None):
        raise InvalidRequest("LOAD needs exactly one of 'ref' and 'key'")
    ref = ref_of(meta.ref) if meta.ref is not None else None
    key = key_of(meta.key) if meta.key is not None else None
    if meta.layers is not None:
        named = ref.key if ref is not None else key
        assert named is not None  # exactly one of them, checked above
        check_layers(named, meta.layers)
    return LoadRequest(
        tenant=tenant,
        namespace=Namespace(namespace),
        ref=ref,
        key=key,
        tensors=specs_of(meta.tensors) if meta.tensors is not None else None,
        allow_speculative=meta.speculative,
        full_check=meta.recheck,
        layers=meta.layers,
    )


def chosen_regions(result: LoadResult, layers: tuple[int, ...] | None) -> list[memoryview]:
    """The payload regions a load sends: all of them as one view, or a group object's chosen
    layers' regions, in payload order (the client lays them out the same way)."""
    if layers is None:
        return [result.payload]
    return [result.payload[t.offset : t.offset + t.region] for t in chosen(result.header.tensors, layers)]
