"""The publisher thread: each tenant's ZMQ sockets, replay ring and counters (``daemon.events``).

``Streams(specs, *, encoding, buffer, buffer_bytes, hwm, context)`` — one ``Stream`` per
``daemon.config_events.StreamSpec``:

- an XPUB socket bound at ``spec.endpoint`` (vLLM's PUB, plus what a PUB hides). Sends never
  wait. Each is first tried with ``XPUB_NODROP``, which refuses it whole when a subscriber has
  just reached its high-water mark: that is counted (``overflows``) and the batch is sent again
  lossy, as a PUB sends, to every subscriber with room. The full subscriber misses it and every
  batch after it until it reads again (ZMQ sets its pipe aside, so those are not seen here: it
  sees the gap in ``seq`` and replays it from the ring); no other subscriber is held up.
  The subscribe and unsubscribe messages it reads (``XPUB_VERBOSER``) count ``subscriptions``;
- a ROUTER socket at ``spec.replay_endpoint`` (optional) answering vLLM's replay requests
  (``protocol.kv_events``) from the ring: the last ``buffer`` batches, ``buffer_bytes`` at most;
- ``seq``: one counter per stream, one step per batch.

``bind()`` on the caller's thread (an address in use, an ipc path another process listens
on, is a ``ConfigError`` at start), then
``run(queue, wake)`` on the publisher thread until it takes ``None`` from ``queue``: it waits
on every socket and on ``wake`` (an inproc PAIR the loop side pokes after each put), encodes
each ``(stream index, topic, ts, events)`` batch and sends it. Nothing here runs on the event loop.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import stat
from collections import deque
from dataclasses import dataclass, field

import zmq

from statetier.daemon.config_events import StreamSpec
from statetier.protocol.errors import ConfigError
from statetier.protocol.kv_events import REPLAY_END, Encoding, encode_batch, seq_bytes

log = logging.getLogger("statetier.events")


@dataclass
class Stream:
    spec: StreamSpec
    pub: zmq.Socket
    replay: zmq.Socket | None
    ring: deque = field(default_factory=deque)  # (seq, topic, payload), oldest first
    ring_bytes: int = 0
    seq: int = 0
    subscriptions: int = 0


@dataclass
class Counts:
    """Read by the loop side at scrape time; written by the publisher thread only."""

    published: int = 0  # events handed to the socket
    overflows: int = 0  # a subscriber reached its high-water mark: it misses batches until it reads again
    batches: int = 0


class Streams:
    def __init__(self, specs: list[StreamSpec], *, encoding: Encoding, buffer: int, buffer_bytes: int, hwm: int,
                 context: zmq.Context) -> None:
        self.specs = list(specs)
        self.encoding = encoding
        self.buffer, self.buffer_bytes, self.hwm = buffer, buffer_bytes, hwm
        self.context = context
        self.streams: list[Stream] = []
        self.counts = Counts()

    def bind(self) -> None:
        for spec in self.specs:
            for address in (spec.endpoint, spec.replay_endpoint):
                _refuse_live_ipc(address, spec.tenant)
        try:
            for spec in self.specs:
                pub = self.context.socket(zmq.XPUB)
                self.streams.append(Stream(spec, pub, None))
                pub.setsockopt(zmq.LINGER, 0)
                pub.setsockopt(zmq.SNDHWM, self.hwm)
                pub.setsockopt(zmq.XPUB_NODROP, 1)
                pub.setsockopt(zmq.XPUB_VERBOSER, 1)
                pub.bind(spec.endpoint)
                if spec.replay_endpoint is not None:
                    replay = self.streams[-1].replay = self.context.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.bind(spec.replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            where = spec.endpoint if spec.replay_endpoint is None else f"{spec.endpoint} and {spec.replay_endpoint}"
            raise ConfigError(f"events: cannot bind {where} for tenant {spec.tenant!r}: {exc}") from exc

    @property
    def subscriptions(self) -> int:
        return sum(stream.subscriptions for stream in self.streams)

    def run(self, batches: queue.Queue, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        for stream in self.streams:
            poller.register(stream.pub, zmq.POLLIN)
            if stream.replay is not None:
                poller.register(stream.replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if wake in ready:
                for _ in _waiting(wake):
                    pass
            for stream in self.streams:
                if stream.pub in ready:
                    self._count_subscriptions(stream)
                if stream.replay is not None and stream.replay in ready:
                    self._serve_replay(stream, stream.replay)
            while True:
                try:
                    item = batches.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    return
                self.send(*item)

    def send(self, index: int, topic: str, ts: float, events: list) -> None:
        stream = self.streams[index]
        payload = encode_batch(ts, events, self.encoding)
        topic_bytes = topic.encode()
        seq = stream.seq
        stream.seq += 1
        self._keep(stream, seq, topic_bytes, payload)
        self.counts.batches += 1
        message = (topic_bytes, seq_bytes(seq), payload)
        try:
            stream.pub.send_multipart(message, flags=zmq.NOBLOCK)  # refused whole if any subscriber is full
        except zmq.Again:
            self.counts.overflows += 1
            stream.pub.setsockopt(zmq.XPUB_NODROP, 0)  # then to every subscriber with room, as a PUB does
            try:
                stream.pub.send_multipart(message, flags=zmq.NOBLOCK)
            finally:
                stream.pub.setsockopt(zmq.XPUB_NODROP, 1)
        self.counts.published += len(events)

    def _keep(self, stream: Stream, seq: int, topic: bytes, payload: bytes) -> None:
        stream.ring.append((seq, topic, payload))
        stream.ring_bytes += len(payload)
        while len(stream.ring) > self.buffer or stream.ring_bytes > self.buffer_bytes:
            stream.ring_bytes -= len(stream.ring.popleft()[2])

    def _count_subscriptions(self, stream: Stream) -> None:
        for (message,) in _waiting(stream.pub):
            if message[:1] == b"\x01":
                stream.subscriptions += 1
            elif message[:1] == b"\x00":
                stream.subscriptions = max(0, stream.subscriptions - 1)

    def _serve_replay(self, stream: Stream, replay: zmq.Socket) -> None:
        for frames in _waiting(replay):
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("events: a replay request of %d frames ignored (want [identity, b'', seq])", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                for seq, topic, payload in stream.ring:
                    if seq >= start_seq:
                        replay.send_multipart((client, b"", topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
                replay.send_multipart((client, b"", b"", REPLAY_END, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.info("events: a replay to a full requester was cut short")

    def close(self) -> None:
        for stream in self.streams:
            stream.pub.close(linger=0)
            if stream.replay is not None:
                stream.replay.close(linger=0)
        self.streams.clear()


def _waiting(sock: zmq.Socket):
    """Every message ``sock`` has waiting (its frames), without blocking."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


def _refuse_live_ipc(address: str | None, tenant: str) -> None:
    """ZMQ binds an ipc path by replacing whatever file is there: refuse one another process
    listens on (another daemon's stream would be taken over), or a file that is not a socket."""
    if address is None or not address.startswith("ipc://") or address.startswith("ipc://@"):
        return
    path = address[len("ipc://"):]
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ConfigError(f"events: {address} (tenant {tenant!r}) exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return  # nobody listens: a stale file ZMQ replaces
    raise ConfigError(f"events: cannot bind {address} for tenant {tenant!r}: another process listens on it")
