"""A real daemon (Server + Engine over a real HostTier) and a raw-frame client for server tests.

- ``running_daemon(listen=…, limits=…, tenants=…, arena=False, executor=None)`` — async context manager:
  starts an Engine and a Server on a Unix socket in a short temporary directory (plus TCP
  when ``listen["tcp"]`` is set) and shuts both down afterwards. Yields a ``Daemon``.
- ``WireClient`` — frames encoded with ``protocol/frames.py`` over a real socket:
  ``send``, ``recv`` (``None`` at EOF), ``hello``, ``request``.
- ``put_meta(...)`` — the ``PutMeta`` of a valid PUT, and its payload length; ``load_meta``
  — a LOAD by ref or key; ``answer(frame, cls)`` — a hot op's binary reply, decoded.
- ``metric(metrics, name, **labels)`` — one sample of a scrape.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from statetier.daemon.config import Config, LimitsConfig, ListenConfig, TenantConfig
from statetier.daemon.engine import Engine
from statetier.daemon.metrics import Metrics
from statetier.daemon.server import Server
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.frames import Frame, FrameDecoder, Op, encode_frame, hello_frame
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import layout_payload
from statetier.protocol.wire_meta import (
    Key,
    LoadMeta,
    PutMeta,
    Ref,
    decode_reply,
    wire_key,
    wire_provenance,
    wire_specs,
)
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.registry import MemoryVersionRegistry

NS = NamespaceSpec(model_id="server-tests").namespace()
S = TypeVar("S")
HOST_BYTES = 96 * 1024 * 1024


@dataclass
class Daemon:
    server: Server
    engine: Engine
    metrics: Metrics
    config: Config
    directory: Path

    @property
    def socket_path(self) -> str:
        return str(self.config.listen.socket_path)

    async def unix_client(self) -> "WireClient":
        return WireClient(*await asyncio.open_unix_connection(self.socket_path))

    async def tcp_client(self, ssl=None, server_hostname=None) -> "WireClient":
        host, port = self.server.tcp_address
        return WireClient(
            *await asyncio.open_connection(host, port, ssl=ssl, server_hostname=server_hostname)
        )

    def leases(self) -> int:
        return self.engine.stats()["leases"]


@asynccontextmanager
async def running_daemon(*, listen: dict | None = None, limits: dict | None = None,
                         tenants: tuple[TenantConfig, ...] | None = None, arena: bool = False,
                         executor=None):
    directory = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))  # AF_UNIX paths are short
    extra = {} if tenants is None else {"tenants": tenants}
    config = Config(
        listen=ListenConfig(socket_path=directory / "d.sock", **(listen or {})),
        limits=LimitsConfig(**(limits or {})),
        **extra,
    )
    metrics = Metrics()
    host = HostTier(HostTierOptions(HOST_BYTES))
    engine = Engine([host], keyring=Keyring.generate(), registry=MemoryVersionRegistry(),
                    metrics=metrics, arena=host if arena else None, executor=executor)
    await engine.start()
    server = Server(engine, config, metrics)
    try:
        await server.start()
        yield Daemon(server, engine, metrics, config, directory)
    finally:
        await server.shutdown(grace=1.0)
        await engine.close(1.0)
        shutil.rmtree(directory, ignore_errors=True)


class WireClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._decoder = FrameDecoder()
        self._frames: deque[Frame] = deque()
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, frame: Frame) -> None:
        self.writer.writelines(encode_frame(frame))

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self) -> Frame | None:
        """The next frame, or ``None`` once the daemon closed the connection."""
        while not self._frames:
            try:
                data = await self.reader.read(1 << 20)
            except (ConnectionResetError, BrokenPipeError):
                return None
            if not data:
                return None
            self._frames.extend(self._decoder.feed(data))
        return self._frames.popleft()

    async def hello(self, **fields) -> Frame:
        self.send(hello_frame(**fields))
        return await self.recv()

    async def request(self, op: Op, meta: dict | None = None, data: bytes = b"") -> Frame:
        request_id = self.next_id()
        self.send(Frame(op, request_id, meta or {}, data))
        reply = await self.recv()
        assert reply is not None, f"connection closed instead of answering {op.name}"
        assert reply.request_id == request_id
        return reply

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionResetError, BrokenPipeError):
            pass


def put_meta(layer: int = 0, shape: tuple[int, ...] = (16, 64), request_id: str = "req") -> tuple[PutMeta, int]:
    key = StateKey(NS, Kind.KV, layer, bytes(32), 0, 16)
    specs = (TensorSpec("k", "float16", shape),)
    meta = PutMeta(wire_key(key), wire_provenance(Provenance(f"{request_id}-{layer}")), wire_specs(specs))
    return meta, layout_payload(specs).payload_len


def load_meta(*, ref: Ref | None = None, key: Key | None = None, ns: bytes = NS.digest) -> LoadMeta:
    """A LOAD by ``ref`` or ``key`` (as a reply carried them), in namespace ``ns``."""
    return LoadMeta(ns, ref=ref, key=key)


def answer(frame: Frame, cls: type[S]) -> S:
    """A hot op's reply meta, decoded (its REPLY must be binary)."""
    assert frame.op is Op.REPLY and frame.is_binary, frame.meta
    return decode_reply(cls, frame.meta)


def metric(metrics: Metrics, name: str, **labels: str) -> float:
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0
