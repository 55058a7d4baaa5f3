"""The device tier: one preallocated torch ``uint8`` pool on a GPU (or on ``cpu``, for tests).

- ``DeviceTier(DeviceTierOptions(capacity_bytes, device="cpu", …), executor=None)`` — an
  ``ExtentTier`` whose medium is a ``DevicePool``: one tensor of ``capacity_bytes``,
  allocated at ``start()``; objects live in extents of it.
- ``write(ticket, chunks)`` copies host buffers in; ``write_from_tensor(ticket, tensor)``
  copies a tensor's bytes in (device to device on CUDA, no host round trip).
- ``read(lease)`` gives host bytes: on ``cpu`` a read-only view of the pool itself (no
  copy; the pool is a tensor over an anonymous mapping, which outlives ``close()`` while
  a view of it is held); on CUDA a pinned staging buffer held until ``complete_load``.
  ``read(lease, into=dest)`` copies into a caller's buffer instead (the host arena).
- ``compact()``, eviction and leases come from ``ExtentTier``; on ``cpu`` the bytes move
  with ``HostBytes`` (``tiers.memory.hostbytes``), on CUDA with ``TorchBytes``
  (``tiers.memory.torchbytes``).

On CUDA every copy is queued on the tier's side stream and finished by an executor thread
sleeping in the driver on a blocking-sync event (``tiers.memory.torchbytes``): the loop
never blocks, no core spins, and the wake-up is exact, where ``event.query()`` polling would
trade latency against wasted wake-ups. In-flight transfers are bounded by the executor's size.

torch is imported at ``start()``, never at package import. ``single_thread_copies=True``
calls ``torch.set_num_threads(1)`` (PERFORMANCE.md: two threads lose 6× when the other
core is busy) in each executor thread before its first torch copy: under OpenMP the
setting is per thread (threads started later inherit it too), and it changes torch for
everything else in those threads, so it is off unless asked for.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from statetier.protocol.errors import CapacityError, ConfigError, InternalError, StatetierError

from ..base import StoreTicket
from .extent import ExtentTier, ExtentTierOptions
from .hostbytes import HostBytes
from .pins import PinnedJobs
from .rawmemory import address_of, fresh_buffer, release_quietly
from .region import ByteMovers
from .torchbytes import TorchBytes


@dataclass(frozen=True, slots=True)
class DeviceTierOptions(ExtentTierOptions):
    """``ExtentTierOptions`` and the torch device of the pool (``cpu`` or ``cuda:N``);
    ``single_thread_copies``: see the module docstring."""

    name: str = "device"
    device: str = "cpu"
    single_thread_copies: bool = False


class DevicePool:
    """The device tier's medium (an ``ExtentMedium``): the pool tensor and its side stream."""

    def __init__(self, config: DeviceTierOptions) -> None:
        self.name = config.name
        self.device = config.device
        self.capacity = config.capacity_bytes
        self._single_thread_copies = config.single_thread_copies
        self._torch: Any = None
        self._pool: Any = None  # the uint8 tensor of capacity bytes
        self._stream: Any = None  # the side stream, CUDA only
        self._region: memoryview | None = None  # the host memory under a cpu pool
        self.tensors: TorchBytes | None = None  # from movers() on

    @property
    def is_cuda(self) -> bool:
        return self._stream is not None

    def open(self) -> None:
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

    def movers(self, jobs: PinnedJobs, inline_copy_bytes: int) -> ByteMovers:
        self.tensors = TorchBytes(self._torch, self._pool, self._stream, jobs, self._single_thread_copies)
        if self._region is None:
            return self.tensors
        return HostBytes(self._region, address_of(self._region), jobs, inline_copy_bytes)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._pool = self._stream = self.tensors = None  # first: the cpu pool tensor holds an export of the region
        release_quietly(self._region)
        self._region = None

    def translate(self, exc: Exception) -> StatetierError:
        if self._torch is not None and isinstance(exc, self._torch.OutOfMemoryError):
            return CapacityError(f"{self.name}: out of device memory while copying")
        return InternalError(f"{self.name}: device copy failed: {exc}")

    def flat_bytes(self, tensor: Any) -> Any:
        """``tensor``'s bytes as a flat ``uint8`` tensor; on CUDA the side stream first waits
        for the tensor's producer."""
        flat = tensor.detach().contiguous().reshape(-1).view(self._torch.uint8)
        if flat.is_cuda and self.is_cuda:
            self._stream.wait_stream(self._torch.cuda.current_stream(flat.device))
        return flat


class DeviceTier(ExtentTier):
    """Torch pool tier. See the module docstring."""

    def __init__(self, config: DeviceTierOptions, executor: Executor | None = None) -> None:
        self._pool = DevicePool(config)
        self.device = config.device
        super().__init__(config, self._pool, executor, offers_store_view=False)

    @property
    def is_cuda(self) -> bool:
        return self._pool.is_cuda

    async def write_from_tensor(self, ticket: StoreTicket, tensor: Any) -> None:
        """Append ``tensor``'s bytes (any dtype, any device) to the object of ``ticket``."""
        self._region.require_open()
        tensors = self._pool.tensors
        assert tensors is not None
        flat = self._pool.flat_bytes(tensor)
        await self._stores.write_with(ticket, flat.numel(), tensors.write_tensor, flat)
