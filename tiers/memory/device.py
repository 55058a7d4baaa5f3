"""The device tier: one preallocated torch ``uint8`` pool on a GPU (or on ``cpu``, for tests).

- ``DeviceTier(capacity_bytes, *, device="cpu", …)`` — an ``ExtentTier`` over one tensor
  of ``capacity_bytes``, allocated at ``start()``; objects live in extents of it.
- ``write(ticket, chunks)`` copies host buffers in; ``write_from_tensor(ticket, tensor)``
  copies a tensor's bytes in (device to device on CUDA, no host round trip).
- ``read(lease)`` gives host bytes: on ``cpu`` a read-only view of the pool itself (no
  copy; the pool is a tensor over an anonymous mapping, which outlives ``close()`` while
  a view of it is held); on CUDA a pinned staging buffer held until ``complete_load``.
  ``read_into(lease, dest)`` copies into a caller's buffer instead (the host arena).
- ``compact()``, eviction and leases come from ``ExtentTier``; on ``cpu`` the bytes move
  with ``HostMemoryBytes`` (``tiers.memory.hostbytes``).

On CUDA every copy is queued on the tier's side stream (``non_blocking``; a DMA when the
host side is pinned, such as the host tier's registered arena) and finished by recording a
blocking-sync ``torch.cuda.Event`` and calling ``event.synchronize()`` in an executor
thread. That thread sleeps in the driver until the copy is done: the loop never blocks, no
core spins, and the wake-up is exact, where ``event.query()`` polling would trade latency
against wasted wake-ups. In-flight transfers are bounded by the executor's size.

torch is imported at ``start()``, never at package import. ``single_thread_copies=True``
calls ``torch.set_num_threads(1)`` (PERFORMANCE.md: two threads lose 6× when the other
core is busy) in each executor thread before its first torch copy: under OpenMP the
setting is per thread (threads started later inherit it too), and it changes torch for
everything else in those threads, so it is off unless asked for.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from contextlib import ExitStack

from statetier.protocol.errors import CapacityError, ConfigError, InternalError, StatetierError

from ..base import Buffer, StoreTicket
from .extent import DEFAULT_INLINE_COPY_BYTES, ExtentTier
from .hostbytes import HostMemoryBytes
from .placement import LeaseState, Placement
from .rawmemory import address_of, exported, exported_for_write, fresh_buffer, release_quietly, view_at


class DeviceTier(HostMemoryBytes, ExtentTier):
    """Torch pool tier. See the module docstring."""

    holds_verified_bytes = True  # device memory of the daemon's own process

    def __init__(self, capacity_bytes: int, *, device: str = "cpu", high_watermark: float = 0.9,
                 low_watermark: float = 0.75, lease_ttl: float = 30.0, executor: Executor | None = None,
                 name: str = "device", granularity: int = 4096,
                 inline_copy_bytes: int = DEFAULT_INLINE_COPY_BYTES, single_thread_copies: bool = False) -> None:
        super().__init__(capacity_bytes, high_watermark=high_watermark, low_watermark=low_watermark,
                         lease_ttl=lease_ttl, executor=executor, name=name, granularity=granularity,
                         inline_copy_bytes=inline_copy_bytes)
        self.device = device
        self._single_thread_copies = single_thread_copies
        self._thread_state = threading.local()
        self._torch = None
        self._pool = None  # the uint8 tensor of capacity bytes
        self._stream = None  # the side stream, CUDA only

    @property
    def is_cuda(self) -> bool:
        return self._stream is not None

    # ------------------------------------------------------------------ medium

    def _open_medium(self) -> None:
        import torch

        self._torch = torch
        try:
            device = torch.device(self.device)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"{self.name}: bad device {self.device!r}: {exc}") from exc
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"{self.name}: device {self.device!r} is neither cpu nor cuda")
        if device.type == "cpu":
            # an anonymous mapping under the tensor: views handed out keep it alive
            self._region = fresh_buffer(self.capacity)
            self._region_address = address_of(self._region)
            self._pool = torch.frombuffer(self._region, dtype=torch.uint8)
            return
        try:
            pool = torch.empty(self.capacity, dtype=torch.uint8, device=device)
            stream = torch.cuda.Stream(device=device)
        except torch.OutOfMemoryError as exc:
            raise CapacityError(f"{self.name}: cannot allocate {self.capacity} bytes on {device}") from exc
        except (RuntimeError, AssertionError) as exc:  # no CUDA build, no such device
            raise ConfigError(f"{self.name}: device {self.device!r} is unusable: {exc}") from exc
        self._pool, self._stream = pool, stream

    def _close_medium(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._pool = self._stream = None  # first: the cpu pool tensor holds an export of the region
        release_quietly(self._region)
        self._region, self._region_address = None, 0

    def _translate(self, exc: Exception) -> StatetierError:
        if self._torch is not None and isinstance(exc, self._torch.OutOfMemoryError):
            return CapacityError(f"{self.name}: out of device memory while copying")
        return InternalError(f"{self.name}: device copy failed: {exc}")

    # ------------------------------------------------------------------ tensors in

    async def write_from_tensor(self, ticket: StoreTicket, tensor) -> None:
        """Append ``tensor``'s bytes (any dtype, any device) to the object of ``ticket``."""
        self._require_open()
        flat = tensor.detach().contiguous().reshape(-1).view(self._torch.uint8)
        if flat.is_cuda and self.is_cuda:
            # the side stream must not read the tensor before its producer finished it
            self._stream.wait_stream(self._torch.cuda.current_stream(flat.device))
        await self._write_guarded(ticket, flat.numel(), self._tensor_in, flat)

    async def _tensor_in(self, extent: int, position: int, flat) -> None:
        await self._run_job((extent,), self._on_stream, self._copy_tensor_job, position, flat)

    def _copy_tensor_job(self, position: int, flat) -> None:
        self._pool[position : position + flat.numel()].copy_(flat, non_blocking=self.is_cuda)
        self._wait_side_stream()

    # ------------------------------------------------------------------ byte movers (CUDA)
    # Each job runs in an executor thread through ``_on_stream`` and ends by waiting for its
    # own copies, inside the scope that keeps its host buffers exported.

    def _on_stream(self, fn, *args):
        """Run ``fn`` in this executor thread with the side stream current (on CUDA)."""
        torch = self._torch
        if self._single_thread_copies and not getattr(self._thread_state, "is_single", False):
            torch.set_num_threads(1)
            self._thread_state.is_single = True
        if self._stream is None:
            return fn(*args)
        with torch.cuda.stream(self._stream):
            return fn(*args)

    def _wait_side_stream(self) -> None:
        """Sleep in the driver until the side stream's copies so far are done."""
        if self._stream is not None:
            done = self._torch.cuda.Event(blocking=True)
            done.record(self._stream)
            done.synchronize()

    def _host_tensor(self, address: int, nbytes: int):
        return self._torch.frombuffer(view_at(address, nbytes), dtype=self._torch.uint8)

    async def _write_chunks(self, extent: int, position: int, views: list[memoryview]) -> None:
        if not self.is_cuda:
            return await super()._write_chunks(extent, position, views)
        await self._run_job((extent,), self._on_stream, self._host_to_device_job, position, views)

    def _host_to_device_job(self, position: int, views: list[memoryview]) -> None:
        with ExitStack() as held:
            for view in views:
                address, nbytes = held.enter_context(exported(view))
                if nbytes:
                    self._pool[position : position + nbytes].copy_(self._host_tensor(address, nbytes),
                                                                   non_blocking=True)
                position += nbytes
            self._wait_side_stream()

    async def _read_view(self, state: LeaseState, placement: Placement) -> memoryview:
        if not self.is_cuda:
            return await super()._read_view(state, placement)
        staging = await self._run_job((placement.offset,), self._on_stream, self._to_staging_job,
                                      placement.offset, placement.nbytes)
        state.keepalive.append(staging)
        return view_at(staging.data_ptr(), placement.nbytes).toreadonly()

    def _to_staging_job(self, offset: int, nbytes: int):
        torch = self._torch
        staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # torch caches these
        staging.copy_(self._pool[offset : offset + nbytes], non_blocking=True)
        self._wait_side_stream()
        return staging

    async def _copy_to(self, placement: Placement, dest: Buffer) -> None:
        if not self.is_cuda:
            return await super()._copy_to(placement, dest)
        await self._run_job((placement.offset,), self._on_stream, self._device_to_host_job,
                            [(placement.offset, placement.nbytes, dest)])

    def _device_to_host_job(self, items: list[tuple[int, int, Buffer]]) -> None:
        with ExitStack() as held:
            for offset, nbytes, dest in items:
                address, _ = held.enter_context(exported_for_write(dest))
                self._host_tensor(address, nbytes).copy_(self._pool[offset : offset + nbytes], non_blocking=True)
            self._wait_side_stream()

    async def _copy_out(self, placements: list[Placement]) -> list[Buffer]:
        if not self.is_cuda:
            return await super()._copy_out(placements)
        items = [(p.offset, p.nbytes, fresh_buffer(p.nbytes)) for p in placements]
        await self._run_job(tuple(p.offset for p in placements), self._on_stream, self._device_to_host_job, items)
        return [blob for _, _, blob in items]

    async def _move(self, src: int, dst: int, nbytes: int) -> None:
        if not self.is_cuda:
            return await super()._move(src, dst, nbytes)
        await self._run_job((src, dst), self._on_stream, self._move_job, src, dst, nbytes)

    def _move_job(self, src: int, dst: int, nbytes: int) -> None:
        self._pool[dst : dst + nbytes].copy_(self._pool[src : src + nbytes], non_blocking=True)
        self._wait_side_stream()
