"""The put and load calls of ``AsyncClient``: tensors in, sealed; tensors out, verified.

- ``TransferCalls`` (a ``ClientSession``): ``put`` / ``put_kv`` / ``put_ssm`` / ``put_group``
  / ``put_many`` → ``StoredRef``s; ``load`` / ``load_with_ref`` / ``load_group`` /
  ``load_many`` → ``{name: tensor}`` (fresh, or the caller's ``into`` filled in place),
  every tensor verified where it lands. The exchanges are ``transfers.Transfers``'s; batch
  calls are cut into frames by ``batches``.
- ``Expect`` — what a load may say it expects of each tensor: ``{name: (dtype, shape)}``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from typing import Any, Iterable, Mapping, Sequence

import torch

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.identity import Provenance, StateKey, StateRef
from statetier.protocol.kv_events import BlockTag
from statetier.protocol.wire_meta import LoadMeta, PutMeta, wire_key, wire_provenance, wire_ref, wire_specs

from .batches import BATCH_ITEMS, batches_of, in_order, items_from, load_batch_items, pairs_bytes
from .copies import into_specs
from .session import ClientSession, checked_concurrency
from .tensors import dtype_name
from .values import PutItem, group_selection, payload_pairs, regrouped

Expect = Mapping[str, tuple[Any, Sequence[int]]]


class TransferCalls(ClientSession):
    """See the module docstring."""

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
        if concurrency is not None and checked_concurrency(concurrency) != 1:
            raise InvalidRequest(f"put_many sends one frame at a time (a stream's versions are claimed in order); "
                                 f"concurrency={concurrency} cannot be honoured")
        transfers = self._transfers_now()
        prepared = [self._put_meta(item.key, item.tensors, item.request_id, item.step, item.publish,
                                   item.version, item.speculative, item.durable, item.tag)
                    for item in items]
        batches = batches_of(prepared, self._batch_bytes(), lambda entry: pairs_bytes(entry[1]))
        refs = await _put_streamed(transfers, batches, trace)
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
        elif device is None:
            device = "cpu"
        return await self._transfers_now().load(meta, device, into, trace)

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
        depth = self.concurrency if concurrency is None else checked_concurrency(concurrency)
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


async def _put_streamed(transfers, batches: list[list], trace: dict | None) -> list[StateRef]:
    """Each batch in one ``PUT_BATCH``, in order; a batch of at most half the put window is
    filled into it while the one before is in flight, a larger one (an item alone) once that
    one was answered. A batch whose early fill fails is filled again in its turn, after the
    ones before it were stored, so that its error is raised in place (``items_from``)."""
    refs: list[StateRef] = []
    filled = None
    for n, batch in enumerate(batches):
        with items_from(len(refs)):
            if filled is None:
                filled = await transfers.fill_put_batch(batch)
            sending = asyncio.ensure_future(transfers.send_put_batch(filled, trace))
        filled = None
        try:
            await asyncio.sleep(0)  # written before the next fill holds the loop
            filled = await _maybe_fill_early(transfers, batches[n + 1] if n + 1 < len(batches) else None)
            with items_from(len(refs)):
                refs.extend(await sending)
        except BaseException:
            if filled is not None:
                filled.free()
            if not sending.done():
                sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
            raise
    return refs


async def _maybe_fill_early(transfers, batch: list | None):
    """``batch`` filled into the put window now (``FilledPuts``), or None: no batch, one too
    large to lie beside another, or one whose fill failed (its turn raises that again)."""
    if batch is None:
        return None
    try:
        if not transfers.fits_beside_another(batch):
            return None
        return await transfers.fill_put_batch(batch)
    except StatetierError:
        return None


def _expected_specs(expect: Expect) -> list[TensorSpec]:
    specs = []
    for name, (dtype, shape) in expect.items():
        wire_dtype = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
        specs.append(TensorSpec(name, wire_dtype, tuple(shape)))
    return specs
