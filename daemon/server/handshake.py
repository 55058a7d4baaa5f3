"""A connection's handshake: the HELLO that admits a client, and the HELLO_OK that answers it.

- ``admit(hello, tenants, peer, tls_verified=, window_bytes=)`` → ``Admission``: the
  negotiated protocol version, the tenant, and the connection's shared-memory ``Windows``
  (``None``: the inline path). Raises the ``StatetierError`` that refuses the client (not
  a HELLO, no common version, credentials that map to no tenant).
- ``send_with_fds(transport, frame, fds, max_frame)`` — HELLO_OK with the windows'
  descriptors attached (``SCM_RIGHTS``); False when it could not be sent so.
- ``HANDSHAKE_TIMEOUT_SECONDS`` — how long a new connection has to say HELLO.

Used by ``connection.Connection``, once per connection, before any request runs.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from dataclasses import dataclass

from statetier.daemon.server.auth import PeerCredentials, TenantDirectory
from statetier.daemon.server.windows import Windows
from statetier.protocol.errors import ProtocolError
from statetier.protocol.frames import Frame, Op, encode_frame, negotiate
from statetier.protocol.messages import field

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Admission:
    """What a HELLO settled: protocol version, tenant, and windows when the client gets them."""

    version: int
    tenant: str
    windows: Windows | None


def admit(hello: Frame, tenants: TenantDirectory, peer: PeerCredentials | None, *, tls_verified: bool,
          window_bytes: int) -> Admission:
    """Admit the client that sent ``hello`` (``window_bytes`` 0: no shared-memory windows)."""
    if hello.op is not Op.HELLO:
        raise ProtocolError(f"the first frame must be HELLO, not {hello.op.name}")
    version = negotiate(hello.meta.get("versions"))
    tenant = tenants.resolve(hello.meta, peer, tls_verified)
    return Admission(version, tenant, _open_windows(hello.meta, window_bytes))


def _open_windows(hello: dict, window_bytes: int) -> Windows | None:
    wanted = field(hello, "shm", bool, default=False)
    if not wanted or window_bytes <= 0:
        return None
    try:
        return Windows.open(window_bytes, window_bytes)
    except OSError as exc:
        log.warning("no shared-memory windows for a client (it uses the inline path): %s", exc)
        return None


def send_with_fds(transport: asyncio.Transport, frame: Frame, fds: list[int], max_frame: int) -> bool:
    """Send ``frame`` with ``fds`` attached (``SCM_RIGHTS``), straight on the socket.

    Only at the handshake, when nothing else was written yet, so the bytes stay in
    order with what the transport writes later. False when it could not be sent so
    (the caller then sends the frame without windows).
    """
    sock = transport.get_extra_info("socket")
    if sock is None or transport.get_write_buffer_size():
        return False
    data = b"".join(bytes(part) for part in encode_frame(frame, max_frame))
    raw = socket.socket(fileno=os.dup(sock.fileno()))
    try:
        sent = raw.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    except OSError as exc:
        log.warning("could not pass shared-memory windows to a client: %s", exc)
        return False
    finally:
        raw.close()
    if sent < len(data):
        transport.write(data[sent:])  # the descriptors went with the first byte
    return True
