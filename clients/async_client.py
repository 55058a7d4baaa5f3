"""The asyncio client of the statetier daemon: torch tensors in, verified tensors out.

``AsyncClient(url, *, namespace, tenant, token, ssl, use_shm, producer_id, timeout,
concurrency)`` (``concurrency``: a ``load_many``'s frames in flight, at least 1); ``await
connect()`` / ``await close()`` or ``async with``. One connection carries every call, many
at once. Keys are built in the client's namespace (``kv_key`` / ``ssm_key`` / ``group_key``).

- ``put(key, tensors, *, request_id, step, publish, version, speculative, durable)`` →
  ``StoredRef`` (a ``StateRef`` plus ``tier`` and ``durable``);
  ``put_kv(layer, prefix_hash, token_start, token_end, tensors, ...)`` and
  ``put_ssm(layer, prefix_hash, tokens_absorbed, {"conv": t, "ssm": t}, ...)`` build the key.
- Group objects (one object per block for every layer of a ``LayerGroup``):
  ``group_key(group, prefix_hash, token_start, token_end, *, shard)``; ``put_group(key,
  {layer: {name: tensor}}, ...)``; ``load_group(target, *, layers, into)`` →
  ``{layer: {name: tensor}}``, the whole object or only the chosen layers' regions (the
  daemon sends only those), into the caller's buffers when given.
- ``load(ref_or_key, *, device, expect, into)`` → ``{name: tensor}``, fresh tensors or the
  caller's ``into`` filled in place; ``load_with_ref`` also returns the ``StateRef`` of
  what was loaded. Loads carry the client's own namespace; every tensor is verified
  against the signed header's digests where it lands.
- ``lookup(attention_layers, ssm_layers, boundaries | token_ids=…, groups=…, ...)`` →
  ``LookupResult`` (per-layer objects and group objects alike);
  ``release(lease_ids)`` gives the leases back.
- ``put_many(items)`` / ``load_many(targets, into=…)``: batch frames, one round trip per batch;
  group objects too (a ``PutItem`` of regions; a group target's ``into`` per layer).
- ``delete(ref)``, ``purge(namespace | tenant=)``, ``list_objects(all_tenants=)``, ``stats()``,
  ``inspect(state_id)``, ``verify(progress=)``, ``ping()``.
- ``owned_namespace``: the namespace the daemon stores this client's objects under (its
  tenant's, ``protocol.ownership``); ``events_topic(template)``: its topic in the daemon's KV
  event stream (docs/integration.md).

Through the connection's own shared-memory windows on a Unix socket (``transfers.py``,
``shm.py``), inline bytes otherwise (TCP, or a process that cannot map them); batch calls
are cut into frames by ``batches.py``. Every failure is a typed ``statetier.protocol.errors``
error; use after ``close()`` raises ``ClientClosedError``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import ssl as _ssl
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import ClientClosedError, InvalidRequest, MalformedFrame
from statetier.protocol.frames import Op
from statetier.protocol.identity import Kind, Namespace, NamespaceSpec, Provenance, StateKey, StateRef
from statetier.protocol.kv_events import BlockTag, event_topic
from statetier.protocol.messages import field, ref_to_wire
from statetier.protocol.ownership import owned_namespace
from statetier.protocol.wire_meta import (
    LoadMeta,
    LookupReply,
    PutMeta,
    ReleaseMeta,
    ReleaseReply,
    ref_of,
    wire_key,
    wire_provenance,
    wire_ref,
    wire_specs,
)

from . import admin, transport
from .batches import BATCH_ITEMS, LOAD_IN_FLIGHT, batches_of, in_order, items_from, load_batch_items, pairs_bytes
from .copies import into_specs
from .shm import ClientWindows
from .tensors import dtype_name
from .transfers import Transfers
from .replies import decoded
from .values import (
    LayerGroup,
    LookupResult,
    PutItem,
    boundaries_from_tokens,
    group_selection,
    lookup_meta,
    payload_pairs,
    regrouped,
)

#: ``load_many``'s frames in flight unless a client or call says otherwise (measured: two
#: overlap the daemon's reads with this process's copies; see ``batches``)
DEFAULT_CONCURRENCY = LOAD_IN_FLIGHT
log = logging.getLogger("statetier.client")
Expect = Mapping[str, tuple[Any, Sequence[int]]]


class AsyncClient:
    """A connection to the daemon, in one tenant and (for puts and loads) one namespace."""

    def __init__(
        self,
        url: str,
        *,
        namespace: Namespace | NamespaceSpec | None = None,
        tenant: str = "default",
        token: str | None = None,
        ssl: _ssl.SSLContext | None = None,
        use_shm: bool = True,
        producer_id: str = "",
        timeout: float = 10.0,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        self.url = url
        self.spec = namespace if isinstance(namespace, NamespaceSpec) else None
        self.namespace = namespace.namespace() if isinstance(namespace, NamespaceSpec) else namespace
        if self.namespace is not None and not isinstance(self.namespace, Namespace):
            raise InvalidRequest("namespace must be a Namespace, a NamespaceSpec or None")
        self.tenant = tenant
        self.producer_id = producer_id
        self.concurrency = _checked_concurrency(concurrency)
        self._token, self._ssl, self._use_shm, self._timeout = token, ssl, use_shm, timeout
        self._conn: transport.Connection | None = None
        self._transfers: Transfers | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._is_closed = False

    # -- lifecycle ----------------------------------------------------------------------

    async def connect(self) -> "AsyncClient":
        if self._is_closed:
            raise ClientClosedError("the statetier client is closed")
        if self._conn is not None:
            return self
        conn = await transport.connect(self.url, tenant=self.tenant, token=self._token, ssl=self._ssl,
                                       shm=self._use_shm, timeout=self._timeout)
        windows = None
        if conn.shm is not None:
            try:
                windows = ClientWindows.open(conn.shm)
            except OSError as exc:  # this process cannot map them: the inline path still works
                log.warning("statetier: shared-memory windows unusable, using inline transfers: %s", exc)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="statetier-copy")
        self._conn, self._transfers = conn, Transfers(conn, windows, self._executor)
        return self

    async def close(self) -> None:
        """Close the connection (the daemon drops this client's leases) and unmap the arena."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            if self._conn is not None:
                await self._conn.close()
        finally:
            if self._transfers is not None and self._transfers.windows is not None:
                self._transfers.windows.close()  # deferred while a copy still holds a region
            if self._executor is not None:
                self._executor.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    @property
    def uses_shm(self) -> bool:
        """Whether puts and loads go through the connection's shared-memory windows."""
        return self._transfers is not None and self._transfers.windows is not None

    @property
    def server_info(self) -> dict:
        """HELLO_OK as the daemon sent it (version, max_frame, max_inflight, shm, tenant …)."""
        return dict(self._connection().hello)

    @property
    def owned_namespace(self) -> Namespace:
        """The namespace the daemon keeps this client's objects under: ``namespace`` taken into
        the tenant HELLO_OK named (``protocol.ownership``). Refs, ``statetier ls`` and the KV
        events carry it; a connected client with a namespace only."""
        return owned_namespace(self._admitted_tenant(), self._own_namespace())

    def events_topic(self, template: str = "{namespace}") -> str:
        """The topic of this client's namespace in its tenant's KV event stream, ``template``
        being the daemon's ``events.topic``: what a SUB socket subscribes to for its events."""
        return event_topic(template, self._admitted_tenant(), self.owned_namespace.digest)

    def _admitted_tenant(self) -> str:
        tenant = self._connection().hello.get("tenant")
        if not isinstance(tenant, str):
            raise MalformedFrame("HELLO_OK names no tenant")
        return tenant

    # -- keys ---------------------------------------------------------------------------

    def kv_key(self, layer: int, prefix_hash: bytes, token_start: int, token_end: int, *,
               shard: int = 0, group_layers: Sequence[int] = ()) -> StateKey:
        """The key of the KV page of ``layer`` covering ``[token_start, token_end)``."""
        return StateKey(self._own_namespace(), Kind.KV, layer, prefix_hash, token_start, token_end,
                        shard, tuple(group_layers))

    def ssm_key(self, layer: int, prefix_hash: bytes, tokens_absorbed: int, *, shard: int = 0) -> StateKey:
        """The key of ``layer``'s snapshot after ``tokens_absorbed`` tokens of ``prefix_hash``."""
        return StateKey(self._own_namespace(), Kind.SSM, layer, prefix_hash, 0, tokens_absorbed, shard)

    def group_key(self, group: LayerGroup, prefix_hash: bytes, token_start: int, token_end: int, *,
                  shard: int = 0) -> StateKey:
        """The key of ``group``'s object: a KV group's block ``[token_start, token_end)`` of every
        layer, an SSM group's snapshots of every layer after ``token_end`` tokens (``token_start`` 0)."""
        return group.key(self._own_namespace(), prefix_hash, token_start, token_end, shard)

    # -- puts ---------------------------------------------------------------------------

    async def put(self, key: StateKey, tensors, *, request_id: str, step: int = 0, publish: bool = False,
                  version: int | None = None, speculative: bool = False, trace: dict | None = None,
                  durable: bool = False, tag: BlockTag | None = None) -> StateRef:
        """Seal ``tensors`` (``{name: tensor}`` or ``[(name, tensor)]``, in payload order) under ``key``.

        Returns a ``StoredRef`` (a ``StateRef`` that also says ``tier``, ``published`` and
        ``durable``). ``durable=True`` waits until a durable tier (the disk tier with fsync)
        holds the object; ``ref.durable`` says whether it does (docs/operations.md, durability).
        ``trace``: a dict to fill with this call's measured phases in µs (``client_copy``,
        ``round_trip``, and the daemon's ``daemon_*``), as ``statetier bench`` prints them.
        ``tag``: the engine's name for this block (``protocol.kv_events.BlockTag``), which the
        daemon's KV events carry instead of the key's prefix hash (docs/integration.md).
        """
        meta, pairs = self._put_meta(key, tensors, request_id, step, publish, version, speculative, durable, tag)
        return await self._transfers_now().put(meta, pairs, trace)

    async def put_group(self, key: StateKey, regions: Mapping[int, Mapping[str, torch.Tensor]], *, request_id: str,
                        step: int = 0, publish: bool = False, version: int | None = None, speculative: bool = False,
                        durable: bool = False) -> StateRef:
        """Seal a group object: ``regions`` holds ``{name: tensor}`` for every layer of ``key``'s
        group and no other (``PlacementMismatch`` otherwise, before anything is sent)."""
        if not key.group_layers:
            raise InvalidRequest("put_group needs a group key (group_key)")
        return await self.put(key, regions, request_id=request_id, step=step, publish=publish, version=version,
                              speculative=speculative, durable=durable)

    def _put_meta(self, key, tensors, request_id, step, publish, version, speculative, durable=False, tag=None):
        pairs = payload_pairs(key, tensors)
        provenance = Provenance(request_id, step, self.producer_id, time.time_ns())
        meta = PutMeta(wire_key(key), wire_provenance(provenance), (), bool(publish), bool(speculative), version,
                       durable=bool(durable), tag=tag)
        return meta, pairs

    async def put_kv(self, layer: int, prefix_hash: bytes, token_start: int, token_end: int, tensors, *,
                     request_id: str, step: int = 0, shard: int = 0, publish: bool = False,
                     version: int | None = None, speculative: bool = False, durable: bool = False) -> StateRef:
        key = self.kv_key(layer, prefix_hash, token_start, token_end, shard=shard)
        return await self.put(key, tensors, request_id=request_id, step=step, publish=publish,
                              version=version, speculative=speculative, durable=durable)

    async def put_ssm(self, layer: int, prefix_hash: bytes, tokens_absorbed: int, tensors, *,
                      request_id: str, step: int = 0, shard: int = 0, publish: bool = False,
                      version: int | None = None, speculative: bool = False, durable: bool = False) -> StateRef:
        key = self.ssm_key(layer, prefix_hash, tokens_absorbed, shard=shard)
        return await self.put(key, tensors, request_id=request_id, step=step, publish=publish,
                              version=version, speculative=speculative, durable=durable)

    async def put_many(self, items: Iterable[PutItem], *, concurrency: int | None = None,
                       trace: dict | None = None) -> list[StateRef]:
        """Put every item; the refs come back in the items' order. Items travel in
        ``PUT_BATCH`` frames (one round trip per batch of up to ``batches.BATCH_ITEMS``); the first
        failing item's error is raised, its position among ``items`` in ``detail["item"]``
        (the items before it are stored). The frames go one at a time, in order (the versions
        of a stream are claimed in order): ``concurrency`` may only be None or 1, anything
        else is ``InvalidRequest``. ``trace``: as for ``put``, summed over the call's frames
        (``items``: how many)."""
        if concurrency is not None and _checked_concurrency(concurrency) != 1:
            raise InvalidRequest(f"put_many sends one frame at a time (a stream's versions are claimed in order); "
                                 f"concurrency={concurrency} cannot be honoured")
        transfers = self._transfers_now()
        prepared = [self._put_meta(item.key, item.tensors, item.request_id, item.step, item.publish,
                                   item.version, item.speculative, item.durable, item.tag)
                    for item in items]
        refs: list[StateRef] = []
        for batch in batches_of(prepared, self._batch_bytes(), lambda entry: pairs_bytes(entry[1])):
            with items_from(len(refs)):
                refs.extend(await transfers.put_batch(batch, trace))
        if trace is not None:
            trace["items"] = len(refs)
        return refs

    # -- loads --------------------------------------------------------------------------

    async def load(self, target: StateRef | StateKey, *, device: torch.device | str | None = None,
                   expect: Expect | None = None, speculative: bool = False,
                   into: Mapping[str, torch.Tensor] | None = None, trace: dict | None = None
                   ) -> dict[str, torch.Tensor]:
        """The tensors of ``target``: a ``StateRef`` (handoff) or a ``StateKey`` (prefix reuse).

        ``into`` (``{name: tensor}``, contiguous, on one device) is filled in place and
        returned: the object must hold exactly those names, dtypes and shapes
        (``DestinationMismatch`` otherwise, before anything is written; the stored object is
        left as it is). Every tensor is verified
        where it lands; when that check fails the call raises ``CorruptPayload`` and the
        contents of ``into`` are undefined (a CPU destination is the copy that was checked;
        a device destination is written only after its staging copy verified).
        ``trace``: as for ``put`` (plus ``client_hash``, the verification).
        """
        _, tensors = await self.load_with_ref(target, device=device, expect=expect, speculative=speculative,
                                              into=into, trace=trace)
        return tensors

    async def load_with_ref(self, target: StateRef | StateKey, *, device: torch.device | str | None = None,
                            expect: Expect | None = None, speculative: bool = False,
                            into: Mapping[str, torch.Tensor] | None = None, trace: dict | None = None
                            ) -> tuple[StateRef, dict[str, torch.Tensor]]:
        """Like ``load``, plus the ``StateRef`` of the object that was loaded."""
        meta = self._load_meta(target, speculative)
        if into is not None and expect is not None:
            raise InvalidRequest("give into or expect, not both: into states what it expects")
        if expect is not None:
            meta.tensors = wire_specs(_expected_specs(expect))
        if into is not None:
            meta.tensors = wire_specs(into_specs(into))
            return await self._transfers_now().load(meta, device, into, trace)
        return await self._transfers_now().load(meta, "cpu" if device is None else device, None, trace)

    async def load_many(self, targets: Iterable[StateRef | StateKey], *, device: torch.device | str | None = None,
                        expect: Expect | None = None, into: Sequence[Mapping[str, torch.Tensor]] | None = None,
                        concurrency: int | None = None, trace: dict | None = None) -> list[dict[str, torch.Tensor]]:
        """Load every target; results come back in the targets' order. Targets travel in
        ``LOAD_BATCH`` frames, about ``batches.LOAD_PIPELINE`` of them with two in flight, so
        that the daemon reads one frame's objects while this process copies and verifies the
        other's; the first failing target's error is raised, its position among ``targets``
        in ``detail["item"]`` (destinations of the frames from its own on are left
        undefined). ``into``: one destination mapping per target (see ``load``; for a group
        target ``{layer: {name: tensor}}``, its layers the chosen ones, see ``load_group``).
        A group target's result is ``{layer: {name: tensor}}``. ``trace``: as for ``load``,
        summed over the call's frames (``items``: how many).
        ``concurrency`` (default: the client's, ``DEFAULT_CONCURRENCY``) is the most frames
        in flight at once (at least 1; the call has about ``batches.LOAD_PIPELINE`` frames,
        so more than that changes nothing); 1 sends the frames one after the other, so
        nothing is asked after the first failure."""
        targets = list(targets)
        if into is not None and len(into) != len(targets):
            raise InvalidRequest(f"into has {len(into)} destinations for {len(targets)} targets")
        if into is not None and expect is not None:
            raise InvalidRequest("give into or expect, not both: into states what it expects")
        transfers = self._transfers_now()
        intos: list[Mapping[str, Any] | None] = list(into) if into is not None else [None] * len(targets)
        metas, grouped = [], []
        for n, (target, dest) in enumerate(zip(targets, intos)):
            meta = self._load_meta(target, False)
            meta.ns = None  # given once for the batch
            key = target.key if isinstance(target, StateRef) else target
            if key.group_layers:
                layers, dest = group_selection(key, None, dest)
                intos[n] = dest
                grouped.append(n)
                if layers is not None:
                    meta.layers = tuple(layers)
            if dest is not None:
                meta.tensors = wire_specs(into_specs(dest))
            elif expect is not None:
                meta.tensors = wire_specs(_expected_specs(expect))
            metas.append(meta)
        pairs = list(zip(metas, intos))
        depth = self.concurrency if concurrency is None else _checked_concurrency(concurrency)
        per_frame = load_batch_items(len(pairs)) if depth > 1 else BATCH_ITEMS
        batches = batches_of(pairs, self._batch_bytes(), lambda _pair: 0, per_frame)
        namespace = self._own_namespace().digest
        starts = itertools.accumulate((len(batch) for batch in batches[:-1]), initial=0)

        async def one(batch: list, start: int) -> list[dict[str, torch.Tensor]]:
            with items_from(start):
                return await transfers.load_batch([m for m, _ in batch], namespace, device, [d for _, d in batch],
                                                  trace)

        done = await in_order([functools.partial(one, batch, start) for batch, start in zip(batches, starts)],
                              depth)
        out: list = [loaded for batch in done for loaded in batch]
        for n in grouped:
            out[n] = regrouped(out[n])
        if trace is not None:
            trace["items"] = len(out)
        return out

    async def load_group(self, target: StateRef | StateKey, *, layers: Sequence[int] | None = None,
                         into: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
                         device: torch.device | str | None = None, speculative: bool = False
                         ) -> dict[int, dict[str, torch.Tensor]]:
        """A group object's tensors as ``{layer: {name: tensor}}``: every layer, or only
        ``layers`` (the daemon then sends only their regions); into ``into``'s tensors when
        given (its layers are the chosen ones). A layer outside the group is
        ``PlacementMismatch``; otherwise as ``load``."""
        key = target.key if isinstance(target, StateRef) else target
        layers, flat = group_selection(key, layers, into)
        meta = self._load_meta(target, speculative)
        if layers is not None:
            meta.layers = tuple(layers)
        if flat is not None:
            meta.tensors = wire_specs(into_specs(flat))
        _, tensors = await self._transfers_now().load(meta, device if flat or device else "cpu", flat)
        return regrouped(tensors)

    def _load_meta(self, target, speculative: bool) -> LoadMeta:
        if isinstance(target, StateRef):
            return LoadMeta(self._own_namespace().digest, ref=wire_ref(target), speculative=bool(speculative))
        if isinstance(target, StateKey):
            return LoadMeta(self._own_namespace().digest, key=wire_key(target), speculative=bool(speculative))
        raise InvalidRequest(f"load takes a StateRef or a StateKey, not {type(target).__name__}")

    def _batch_bytes(self) -> int:
        """Payload bytes per batch frame: what one frame (and the put window) can carry."""
        limit = self._connection().max_frame - (1 << 20)
        windows = self._transfers_now().windows
        if windows is not None:
            limit = min(limit, windows.put_window.nbytes // 2)
        return max(limit, 1)

    # -- lookup and leases --------------------------------------------------------------

    async def lookup(self, attention_layers: Sequence[int] = (), ssm_layers: Sequence[int] = (),
                     boundaries: Sequence[tuple[int, bytes]] | None = None, *,
                     token_ids: Sequence[int] | None = None, block_size: int | None = None,
                     kv_layout: str = "blocks", tp_size: int | None = None, lease: bool = True,
                     groups: Sequence[LayerGroup] = ()) -> LookupResult:
        """The largest prefix that every listed layer and layer group can restore (DESIGN §4,
        joint hits), on every TP shard: ``tp_size`` defaults to the ``NamespaceSpec``'s (1
        without one). A KV group needs its group objects (one per block, or ``[0, N)`` with
        ``kv_layout="prefix"``), an SSM group its group object at the boundary.

        Give ``boundaries`` as ascending ``(token_end, prefix_hash)`` pairs, or ``token_ids``
        (hashed per ``block_size``, by default the namespace's ``kv_block_size``). Leased
        objects stay pinned until ``release(result.lease_ids)``.
        """
        if (boundaries is None) == (token_ids is None):
            raise InvalidRequest("lookup takes either boundaries or token_ids")
        if token_ids is not None:
            size = block_size or (self.spec.kv_block_size if self.spec else None)
            if not size:
                raise InvalidRequest("lookup by token_ids needs block_size (or a NamespaceSpec)")
            boundaries = boundaries_from_tokens(token_ids, size, self.spec.hash_seed if self.spec else 0)
        assert boundaries is not None  # given, or made from token_ids
        meta = lookup_meta(self._own_namespace().digest, attention_layers, ssm_layers, boundaries, kv_layout=kv_layout,
                           lease=lease,
                           tp_size=tp_size if tp_size is not None else (self.spec.tp_size if self.spec else 1),
                           groups=groups)
        reply = decoded(LookupReply, await self._request(Op.LOOKUP, meta))
        return LookupResult(reply.tokens, [(ref_of(ref), lease) for ref, lease in reply.objects])

    async def release(self, lease_ids: Iterable[int]) -> int:
        """Give leases back (from ``lookup``); returns how many the daemon still held."""
        leases = [int(x) for x in lease_ids]
        if not leases:
            return 0
        return decoded(ReleaseReply, await self._request(Op.RELEASE, ReleaseMeta(tuple(leases)))).released

    # -- administration -----------------------------------------------------------------

    async def delete(self, ref: StateRef) -> int:
        frame = await self._request(Op.DELETE, {"ref": ref_to_wire(ref)})
        return field(frame.meta, "deleted", int, default=0)

    async def stats(self) -> dict:
        return await admin.stats(self._connection())

    async def inspect(self, state_id: bytes | str) -> dict:
        return await admin.inspect(self._connection(), state_id)

    async def verify(self, progress: Callable[[int, int], object] | None = None, *,
                     poll_seconds: float = 0.25) -> dict:
        """Re-check every stored object (of this tenant); the report. ``progress(done, total)``
        is called as the daemon goes, every ``poll_seconds``, and once more at the end."""
        return await admin.verify(self._connection(), progress, poll_seconds=poll_seconds)

    async def list_objects(self, *, all_tenants: bool = False) -> dict:
        """What is stored, one row per (tenant, namespace): objects, bytes, copies per tier,
        objects per kind, oldest and newest ``created_at_ns`` (``statetier ls``). This
        connection's tenant's rows; every tenant's with ``all_tenants`` (an operator only)."""
        return await admin.list_objects(self._connection(), all_tenants=all_tenants)

    async def purge(self, namespace: Namespace | NamespaceSpec | None = None, *, tenant: str | None = None) -> dict:
        """Remove every object of ``namespace`` from every tier, Redis included — or, with
        ``tenant``, of every namespace of that tenant (this connection's own, or any for an
        operator). The default (this client's namespace) and a ``NamespaceSpec`` are sent as
        this connection's tenant owns them, since an operator's digest is taken as it is (as
        ``statetier ls --all`` shows it); a ``Namespace`` is sent as it is. Loads in flight
        finish; counts come back: ``objects``, ``bytes``, ``copies``, ``by_tier``,
        ``namespaces``, ``unavailable``."""
        if tenant is not None:
            if namespace is not None:
                raise InvalidRequest("purge takes a namespace or a tenant, not both")
            return await admin.purge(self._connection(), tenant=tenant)
        if namespace is None:
            namespace = self.owned_namespace
        elif isinstance(namespace, NamespaceSpec):
            namespace = owned_namespace(self._admitted_tenant(), namespace.namespace())
        return await admin.purge(self._connection(), namespace.hex())

    async def ping(self) -> float:
        """One round trip to the daemon; returns its duration in seconds."""
        started = time.perf_counter()
        await self._request(Op.PING, {})
        return time.perf_counter() - started

    # -- internals ----------------------------------------------------------------------

    def _connection(self) -> transport.Connection:
        if self._is_closed:
            raise ClientClosedError("the statetier client is closed")
        if self._conn is None:
            raise ClientClosedError("the statetier client is not connected: await connect() first")
        return self._conn

    def _transfers_now(self) -> Transfers:
        self._connection()
        assert self._transfers is not None  # made with the connection
        return self._transfers

    async def _request(self, op: Op, meta):
        return await self._connection().request(op, meta)

    def _own_namespace(self) -> Namespace:
        if self.namespace is None:
            raise InvalidRequest("this client has no namespace: pass namespace= to put, load or lookup")
        return self.namespace


def _checked_concurrency(concurrency: int) -> int:
    """A count of frames in flight: an int of at least 1, else ``InvalidRequest``."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidRequest(f"concurrency must be an int of at least 1, not {concurrency!r}")
    return concurrency


def _expected_specs(expect: Expect) -> list[TensorSpec]:
    specs = []
    for name, (dtype, shape) in expect.items():
        wire_dtype = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
        specs.append(TensorSpec(name, wire_dtype, tuple(shape)))
    return specs
