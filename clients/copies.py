"""Payload bytes between torch tensors and buffers, verified where a load lands.

- ``fill(region, layout, tensors)`` — a put's tensors copied into a window region at the
  payload layout's offsets, padding zeroed; ``fill_and_digest(region, layout, tensors,
  alg)`` — the same, each region hashed as it is copied (``copy_and_digest``, over the bytes
  written): its digests, which a windowed put sends so that the daemon seals over them
  without hashing the window again (one copy and one hash per byte on the client);
  ``inline_parts(pairs, layout)`` — the same payload as the tensors' own buffers and zero
  padding, to be written back to back.
- ``laid_out(header, layers)`` — each tensor a load received and where its region starts in
  the payload received: all at their own offsets, or a group object's chosen layers'
  regions back to back (what the daemon sends for ``layers``).
- ``land(header, source, parts, dests, staging, trace)`` — each received tensor (``parts``)
  copied into its destination and **verified there** against the signed header's digests
  (``CorruptPayload(landed=True)`` when the bytes changed on the way: the host buffers it
  wrote are zeroed, so no damaged byte stays in a caller's buffer); a device destination
  is verified in ``staging`` (a private host buffer) first. ``land_all(jobs, staging, trace)``
  lands a batch and returns the indexes that were not intact, to be asked again.
- ``copy_and_digest(dest, source, hasher, trace)`` — the fused copy + digest, in
  chunks of ``protocol.digests.hash_chunk`` (cache-sized; larger for a region hashed on
  several threads, ``thresholds.PARALLEL_HASH_BYTES``); with ``trace`` it also times both.
- ``target_of(into, device)``, ``destinations(parts, into, device, empty)``, ``into_specs(into)``
  — where a load lands: the caller's ``into`` tensors (checked: contiguous, one device,
  the object's names, dtypes and shapes) or fresh ones (``empty``: recycled memory for
  large results, ``results.ResultPool``).

Copies are single-threaded memmoves (memoryview slice assignment) that never touch
torch's thread settings; ``transfers.Transfers`` decides on which thread they run.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import torch

from statetier.protocol.errors import CorruptPayload, DestinationMismatch, InvalidRequest
from statetier.protocol.groups import chosen
from statetier.protocol.passes import PASSES
from statetier.protocol.sealed import (
    DigestAlg,
    SealedHeader,
    TensorDescriptor,
    check_payload_digest,
    hash_chunk,
    region_hasher,
)

from .tensors import byte_view, empty_for, spec_of, tensor_bytes, tensor_to_spec_and_view, torch_dtype

_ZEROS = memoryview(bytes(64))  # alignment padding is below 64 bytes


def fill(region: memoryview, layout, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` into ``region`` at ``layout``'s offsets, zeroing the padding."""
    cursor = 0
    for tensor, offset in zip(tensors, layout.offsets):
        if offset > cursor:
            region[cursor:offset] = _ZEROS[: offset - cursor]
        nbytes = tensor.numel() * tensor.element_size()
        PASSES.count_copied(nbytes)
        if nbytes:
            if tensor.device.type == "cpu":  # a memmove on this thread, never torch's copy pool
                source = byte_view(tensor if tensor.is_contiguous() else tensor_bytes(tensor))
                region[offset : offset + nbytes] = source
            else:
                torch.frombuffer(region[offset : offset + nbytes], dtype=torch.uint8).copy_(tensor_bytes(tensor))
        cursor = offset + nbytes


def fill_and_digest(region: memoryview, layout, tensors: Sequence[torch.Tensor], alg: DigestAlg) -> tuple[bytes, ...]:
    """``fill`` with each region's digest taken as it is copied: the tensor's bytes hashed
    where they were written (a device tensor's after its copy), then its zeroed padding."""
    digests = []
    for tensor, offset, size in zip(tensors, layout.offsets, layout.regions):
        nbytes = tensor.numel() * tensor.element_size()
        hasher = region_hasher(alg, size)
        dest = region[offset : offset + nbytes]
        if nbytes and tensor.device.type == "cpu":  # a memmove on this thread, never torch's copy pool
            copy_and_digest(dest, byte_view(tensor if tensor.is_contiguous() else tensor_bytes(tensor)), hasher)
        elif nbytes:
            torch.frombuffer(dest, dtype=torch.uint8).copy_(tensor_bytes(tensor))
            PASSES.count_copied(nbytes)
            hasher.update(dest)
        if size > nbytes:
            region[offset + nbytes : offset + size] = _ZEROS[: size - nbytes]
            hasher.update(_ZEROS[: size - nbytes])
        digests.append(hasher.digest())
    return tuple(digests)


def laid_out(header: SealedHeader, layers: Sequence[int] | None) -> list[tuple[TensorDescriptor, int]]:
    """``(descriptor, offset in the received payload)`` of each tensor a load received."""
    if layers is None:
        return [(t, t.offset) for t in header.tensors]
    parts, at = [], 0
    for t in chosen(header.tensors, layers):
        parts.append((t, at))
        at += t.region
    return parts


def land(header: SealedHeader, source: memoryview, parts: Sequence[tuple[TensorDescriptor, int]],
         dests: Sequence[torch.Tensor], staging: Callable[[int], torch.Tensor], trace: dict | None = None) -> None:
    """Copy each received tensor (``parts``: descriptor and offset in ``source``) into its
    destination and verify it there; a device destination is verified in ``staging`` first.

    The digest is computed over the destination's bytes (and a private copy of the
    padding), so what is verified is what the caller gets, whatever happens to ``source``
    meanwhile. Regions not received count with the digests the verified header binds.
    """
    digests: dict[int, bytes] = {}  # by id() of the descriptor: zero-size tensors share offsets
    landed: list[memoryview] = []  # the caller's host buffers written so far
    for (t, at), dest in zip(parts, dests):
        hasher = region_hasher(header.digest_alg, t.nbytes)
        src = source[at : at + t.nbytes]
        on_device = dest.device.type != "cpu"
        if t.nbytes:
            stage = staging(t.nbytes)[: t.nbytes] if on_device else dest  # contiguous: checked or fresh
            copy_and_digest(byte_view(stage), src, hasher, trace)
            if not on_device:
                landed.append(byte_view(stage))
        padding = bytes(source[at + t.nbytes : at + t.region])
        if padding:
            hasher.update(padding)
        digest = hasher.digest()
        if digest != t.digest:
            for written in landed:  # damaged bytes are not left in a caller's buffer (a KV pool)
                written[:] = bytes(written.nbytes)
            raise CorruptPayload(f"tensor {t.spec.name!r} changed on its way: its digest does not match the "
                                 "signed header", landed=True)
        if on_device and t.nbytes:
            tensor_bytes(dest).copy_(stage)  # synchronous: the staging buffer is reused
        digests[id(t)] = digest
    check_payload_digest(header, [digests.get(id(t), t.digest) for t in header.tensors])


# What ``land`` takes for one object: its header, the received bytes, where each tensor lies
# in them, and each tensor's destination.
LandJob = tuple[SealedHeader, memoryview, Sequence[tuple[TensorDescriptor, int]], Sequence[torch.Tensor]]


def land_all(jobs: Sequence[LandJob | None], staging: Callable[[int], torch.Tensor],
             trace: dict | None = None) -> list[int]:
    """``land`` every job (``None`` skipped); the indexes whose bytes were not intact where
    they landed (the caller asks for those again, with ``recheck``)."""
    failed = []
    for index, job in enumerate(jobs):
        if job is None:
            continue
        try:
            land(*job, staging, trace)
        except CorruptPayload as exc:
            if not exc.detail.get("landed"):
                raise
            failed.append(index)
    return failed


def copy_and_digest(dest: memoryview, source: memoryview, hasher, trace: dict | None = None) -> None:
    nbytes = source.nbytes
    PASSES.count_copied(nbytes)
    if trace is not None:
        return _copy_and_digest_timed(dest, source, hasher, trace)
    chunk = hash_chunk(nbytes)
    for start in range(0, nbytes, chunk):
        end = min(nbytes, start + chunk)
        dest[start:end] = source[start:end]
        hasher.update(dest[start:end])


def _copy_and_digest_timed(dest: memoryview, source: memoryview, hasher, trace: dict) -> None:
    clock, copying, hashing = time.perf_counter, 0.0, 0.0
    chunk = hash_chunk(source.nbytes)
    for start in range(0, source.nbytes, chunk):
        end = min(source.nbytes, start + chunk)
        t0 = clock()
        dest[start:end] = source[start:end]
        t1 = clock()
        hasher.update(dest[start:end])
        copying, hashing = copying + t1 - t0, hashing + clock() - t1
    trace["client_copy"] = trace.get("client_copy", 0.0) + copying * 1e6
    trace["client_hash"] = trace.get("client_hash", 0.0) + hashing * 1e6


def target_of(into: Mapping[str, torch.Tensor] | None, device) -> torch.device:
    """The device a load lands on: ``into``'s one device (checked), else ``device`` (CPU by default)."""
    if into is None:
        return torch.device(device or "cpu")
    if not isinstance(into, Mapping) or not into:
        raise InvalidRequest("into must be a non-empty {name: tensor} mapping")
    devices = set()
    for name, tensor in into.items():
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequest(f"into[{name!r}] is a {type(tensor).__name__}, not a torch.Tensor")
        if not tensor.is_contiguous():
            raise InvalidRequest(f"into[{name!r}] is not contiguous: a load fills a tensor's memory as it is")
        devices.add(tensor.device)
    if len(devices) != 1:
        raise InvalidRequest(f"into's tensors lie on several devices: {sorted(map(str, devices))}")
    (found,) = devices
    if device is not None and torch.device(device) != found and not (
            torch.device(device).type == found.type and torch.device(device).index is None):
        raise InvalidRequest(f"into's tensors are on {found}, the load asks for {device}")
    return found


def into_specs(into: Mapping[str, torch.Tensor]):
    """The tensor specs a load into ``into`` expects (the daemon refuses others)."""
    return [spec_of(name, tensor) for name, tensor in into.items()]


def destinations(parts: Sequence[tuple[TensorDescriptor, int]], into, device: torch.device,
                 empty: Callable[..., torch.Tensor] = empty_for) -> list[torch.Tensor]:
    """Where each received tensor lands: ``into``'s tensor of its name, or a fresh one
    (``empty(spec, device)``: the client's ``results.ResultPool.empty``)."""
    tensors = [t for t, _ in parts]
    if into is None:
        return [empty(t.spec, device) for t in tensors]
    names = [t.spec.name for t in tensors]
    if sorted(names) != sorted(into):
        raise DestinationMismatch(f"the object holds tensors {names}, not {sorted(into)}")
    dests = []
    for t in tensors:
        dest = into[t.spec.name]
        if dest.dtype != torch_dtype(t.spec.dtype) or tuple(dest.shape) != tuple(t.spec.shape):
            raise DestinationMismatch(f"tensor {t.spec.name!r} is {t.spec.dtype}{list(t.spec.shape)}; into holds "
                                      f"{dest.dtype}{list(dest.shape)}")
        dests.append(dest)
    return dests


def inline_parts(pairs, layout) -> list:
    """The tensors' own buffers and the zero padding between them, back to back (no join)."""
    views = [tensor_to_spec_and_view(name, tensor) for name, tensor in pairs]
    parts, cursor = [], 0
    for (spec, view), offset in zip(views, layout.offsets):
        if offset > cursor:
            parts.append(_ZEROS[: offset - cursor])
        parts.append(view)
        cursor = offset + spec.nbytes
    return parts
