"""A put's device→host copies ordered after the producer's writes (issue 42, item 6).

A GPU tensor handed to a put may still be being written by kernels queued on the caller's
current stream. Its copy into the put window runs later on the client's copy thread, whose
current stream is another one (a thread starts on the device's default stream, and torch's
streams do not synchronize with it): unfenced, that copy reads whatever the kernels have
written so far and the put seals torn KV (ROCm/ATOM#2132, vllm-project/vllm#45704).

- ``producer_fence(tensors, cuda=torch.cuda)`` → ``ProducerFence`` — at save time, on the
  caller's thread: one event recorded on the current stream of each device the tensors lie
  on (the stream the producer wrote them on, as its thread sees it); empty for CPU tensors.
- ``ProducerFence.fenced(copy)`` → the copy job with ``wait()`` first: on the copy thread,
  that thread's current stream on each device waits for the event (``Stream.wait_event``:
  on the device, no host wait), so every copy queued after it reads the finished tensors.

``cuda`` is the seam for ``torch.cuda`` (a test on a machine without CUDA injects a
recording stand-in to check the order of the calls); ``transfers.Transfers`` fences every
put that touches a GPU, and ``scripts/gpu_check.py`` races a write against a save.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ProducerFence:
    """See the module docstring: ``(device, event)`` pairs recorded at save time."""

    cuda: Any
    events: tuple[tuple[Any, Any], ...] = ()

    def wait(self) -> None:
        """The calling thread's current stream on each device waits for its event."""
        for device, event in self.events:
            self.cuda.current_stream(device).wait_event(event)

    def fenced(self, copy: Callable[[], T]) -> Callable[[], T]:
        if not self.events:
            return copy

        def waited() -> T:
            self.wait()
            return copy()

        return waited


def producer_fence(tensors: Iterable[torch.Tensor], cuda: Any = torch.cuda) -> ProducerFence:
    devices = list(dict.fromkeys(t.device for t in tensors if t.device.type != "cpu"))
    events = []
    for device in devices:
        event = cuda.Event()
        event.record(cuda.current_stream(device))
        events.append((device, event))
    return ProducerFence(cuda, tuple(events))
