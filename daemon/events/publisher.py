"""The KV event publisher's event-loop side: what the engine's announcements go into.

``EventPublisher(specs, *, encoding, buffer, buffer_bytes, hwm)`` — built by ``daemon.app``
from ``[events]`` (``daemon.config_events``), one stream per tenant:

- ``start()`` binds every stream's sockets (``ConfigError`` when an address is taken) and
  starts the publisher thread (``daemon.events.streams``); each stream's first batch is an
  ``AllBlocksCleared``: what a router was told by an earlier run no longer holds.
- ``emit(tenant, namespace, event)`` — the sink of ``daemon.engine.announcements``; called
  on the loop, never waits: the event joins its stream's pending batch for its topic (an
  event equal to the one before it is one event), and the pending batches go to the thread
  once per loop iteration, at most ``MAX_BATCH_EVENTS`` events a batch. A batch the thread
  cannot take (``buffer`` batches waiting) is dropped and its events counted (``dropped``): a
  put never waits for a subscriber, nor for the publisher thread. The topic is
  ``protocol.kv_events.event_topic`` of ``namespace``: the owned namespace the object is
  stored under (``protocol.ownership``), as ``AsyncClient.events_topic`` builds it.
- ``stats()`` → ``published``, ``dropped``, ``overflows`` (a subscriber reached its high-water
  mark: ``daemon.events.streams``), ``subscriptions``;
  ``close()`` sends what is pending, stops the thread and closes the sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time

import zmq

from statetier.daemon.config_events import StreamSpec
from statetier.protocol.kv_events import AllBlocksCleared, Encoding, Event, event_topic

from .streams import Streams

MAX_BATCH_EVENTS = 512
_instances = itertools.count()


class EventPublisher:
    def __init__(self, specs: list[StreamSpec], *, encoding: Encoding = "map", buffer: int = 10_000,
                 buffer_bytes: int = 64 << 20, hwm: int = 10_000, clock=time.time) -> None:
        self.specs = list(specs)
        self._index = {spec.tenant: n for n, spec in enumerate(self.specs)}
        self._clock = clock
        self._context = zmq.Context()
        self._streams = Streams(self.specs, encoding=encoding, buffer=buffer, buffer_bytes=buffer_bytes, hwm=hwm,
                                context=self._context)
        self._queue: queue.Queue = queue.Queue(maxsize=buffer)
        self._pending: dict[tuple[int, str], list[Event]] = {}
        self._topics: dict[tuple[int, bytes], str] = {}
        # both made in start(), before anything is published
        self._loop: asyncio.AbstractEventLoop
        self._flush_scheduled = False
        self._wake: zmq.Socket
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._streams.bind()
        address = f"inproc://statetier-events-{next(_instances)}"
        self._wake = self._context.socket(zmq.PAIR)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.bind(address)
        woken = self._context.socket(zmq.PAIR)
        woken.setsockopt(zmq.LINGER, 0)
        woken.connect(address)
        for n, spec in enumerate(self.specs):  # before the thread takes the sockets over
            self._streams.send(n, spec.topic.replace("{namespace}", ""), self._clock(), [AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, args=(woken,), name="statetier-events", daemon=True)
        self._thread.start()

    def _run(self, woken: zmq.Socket) -> None:
        try:
            self._streams.run(self._queue, woken)
        finally:
            woken.close(linger=0)

    def emit(self, tenant: str, namespace: bytes, event: Event) -> None:
        index = self._index.get(tenant)
        if index is None or self._thread is None:
            return
        topic = self._topics.get((index, namespace))
        if topic is None:
            spec = self.specs[index]
            topic = self._topics[(index, namespace)] = event_topic(spec.topic, spec.tenant, namespace)
        pending = self._pending.get((index, topic))
        if pending is None:
            pending = self._pending[(index, topic)] = []
        elif pending[-1] == event:
            return
        pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._thread is None:  # closed meanwhile
            return
        pending, self._pending = self._pending, {}
        for (index, topic), events in pending.items():
            for start in range(0, len(events), MAX_BATCH_EVENTS):
                self._hand_over(index, topic, events[start : start + MAX_BATCH_EVENTS])
        self._poke()

    def _hand_over(self, index: int, topic: str, events: list[Event]) -> None:
        try:
            self._queue.put_nowait((index, topic, self._clock(), events))
        except queue.Full:
            self.dropped += len(events)

    def _poke(self) -> None:
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already waiting: the thread drains every batch when it runs

    def stats(self) -> dict:
        counts = self._streams.counts
        return {"published": counts.published, "dropped": self.dropped, "overflows": counts.overflows,
                "subscriptions": self._streams.subscriptions}

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is None:
            self._context.destroy(linger=0)
            return
        if self._pending:
            self._flush()
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._poke()
        self._thread.join(timeout)
        self._thread = None
        self._wake.close(linger=0)
        self._streams.close()
        self._context.destroy(linger=0)
