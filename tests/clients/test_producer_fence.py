"""Issue 42, item 6: a put of GPU tensors copies them only after the producer's writes.

CUDA is absent here, so ``producer_fence`` is driven through its ``cuda`` seam by a
recording stand-in for ``torch.cuda`` (streams and events that log each call and the thread
that made it): at save time, on the caller's thread, an event is recorded on the current
stream of each device the tensors lie on; on the copy thread, before any copy, that
thread's current stream on each device waits for the event. A put of CPU tensors records
nothing. (``scripts/gpu_check.py`` races a real kernel against a real save when a GPU is lent.)
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from statetier.clients.producer_fence import producer_fence


class RecordingCuda:
    """Stands in for ``torch.cuda``: ``current_stream(device)`` and ``Event()``, logged."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._ids = itertools.count(1)

    def current_stream(self, device):
        return _Stream(self, device, threading.current_thread().name)

    def Event(self):  # noqa: N802 - torch.cuda's name
        return _Event(self, next(self._ids))


class _Stream:
    def __init__(self, cuda: RecordingCuda, device, thread: str) -> None:
        self.cuda, self.device, self.thread = cuda, str(device), thread

    def wait_event(self, event: "_Event") -> None:
        self.cuda.calls.append(("wait_event", self.device, self.thread, event.id))


class _Event:
    def __init__(self, cuda: RecordingCuda, event_id: int) -> None:
        self.cuda, self.id = cuda, event_id

    def record(self, stream: _Stream) -> None:
        self.cuda.calls.append(("record", stream.device, stream.thread, self.id))


def on(device: str):
    """A tensor stand-in on ``device`` (only its ``device`` is read before the copy)."""
    return SimpleNamespace(device=torch.device(device))


def test_the_copy_thread_waits_for_events_recorded_on_the_producers_streams_before_it_copies() -> None:
    cuda = RecordingCuda()
    caller = threading.current_thread().name
    tensors = [on("cuda:0"), on("cuda:1"), on("cuda:0"), on("cpu")]
    fence = producer_fence(tensors, cuda)  # at save time, on the caller's thread
    assert cuda.calls == [("record", "cuda:0", caller, 1), ("record", "cuda:1", caller, 2)]

    def copy() -> str:
        cuda.calls.append(("copy", threading.current_thread().name))
        return "copied"

    with ThreadPoolExecutor(1, thread_name_prefix="copy") as pool:
        assert pool.submit(fence.fenced(copy)).result() == "copied"
    (copier,) = {call[2] for call in cuda.calls[2:4]}
    assert copier != caller
    assert cuda.calls[2:] == [("wait_event", "cuda:0", copier, 1), ("wait_event", "cuda:1", copier, 2),
                              ("copy", copier)]


def test_a_put_of_cpu_tensors_records_nothing_and_copies_as_it_was() -> None:
    cuda = RecordingCuda()

    def copy() -> None: ...

    fence = producer_fence([torch.zeros(4), torch.ones(2)], cuda)
    assert fence.fenced(copy) is copy and cuda.calls == []
