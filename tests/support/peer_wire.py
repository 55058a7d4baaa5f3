"""What the peer tier's tests share: fake owners that speak ``tiers.peer.wire`` as a daemon of
the cluster (``tier_contract.KEYRING``) would, so a puller meets what no daemon of this
release sends.

- ``welcome(writer, key, nonce_p, nonce_o, owner)`` — the WELCOME a fake owner answers a
  ``MAGIC_OWNER`` hello with: its owner id under its MAC.
- ``accept_as_owner(reader, writer, owner)`` — a fake owner's side of the handshake (the hello
  read, the WELCOME, the puller's proof read): the session key.
- ``listening(serve, release=None)`` — ``serve`` (a connection handler) on a free loopback port,
  a context manager giving its ``host:port``; ``release`` set on the way out.
- ``owner_in_the_clear(blobs)`` — an owner of an older release: the pull of one object only
  (no PULL_MANY: an unknown object id is NOT_HERE, a frame that does not verify ends the
  connection), every answer ``OK`` and the bytes in the clear, whatever the pull's size asks.
  A context manager giving its ``host:port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from statetier.protocol.errors import Unauthorized
from statetier.tiers.peer import wire
from tests.support.tier_contract import KEYRING


def welcome(writer: asyncio.StreamWriter, key: bytes, nonce_p: bytes, nonce_o: bytes, owner: str) -> None:
    named = wire.owner_id_bytes(owner)
    writer.write(KEYRING.active.key_id + nonce_o + wire.owner_proof(key, nonce_p, nonce_o, named)
                 + bytes([len(named)]) + named)


async def accept_as_owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, owner: str) -> bytes:
    hello = await reader.readexactly(wire.HELLO_BYTES)
    key, nonce_p, nonce_o = wire.auth_key(KEYRING.active), hello[16:], os.urandom(wire.NONCE_BYTES)
    welcome(writer, key, nonce_p, nonce_o, owner)
    await reader.readexactly(wire.MAC_BYTES)
    return wire.session_key(key, nonce_p, nonce_o)


@contextlib.asynccontextmanager
async def listening(serve, release: asyncio.Event | None = None):
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    try:
        yield f"{host}:{port}"
    finally:
        if release is not None:
            release.set()
        server.close()


@contextlib.asynccontextmanager
async def owner_in_the_clear(blobs: dict[bytes, bytes]):
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session, seq = await accept_as_owner(reader, writer, "old"), 0
        try:
            while True:
                seq += 1
                object_id, _, _ = wire.unpack_pull(session, await reader.readexactly(wire.PULL_BYTES), seq)
                blob = blobs.get(object_id)
                writer.write(wire.ANSWER.pack(wire.NOT_HERE, 0) if blob is None else
                             wire.ANSWER.pack(wire.OK, len(blob)) + blob)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, Unauthorized):
            writer.close()

    async with listening(serve) as address:
        yield address
