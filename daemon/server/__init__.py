"""The server: sockets, frames and connections in front of the engine (DESIGN §7–8).

``Server`` (``listeners.py``: a Unix socket, and TCP with optional TLS) is what the
composition root starts. Per connection:

- ``connection`` — lifecycle, requests in flight, flow control; ``handshake`` — HELLO,
  admission, the windows' descriptors; ``request_task`` — one request run to its answer.
- ``put_handlers`` / ``load_handlers`` — PUT and PUT_BATCH, LOAD and LOAD_BATCH, each one
  ``Engine`` batch call; ``handlers`` — the other opcodes; ``dispatch`` — the opcode →
  handler table.
- ``windows`` — the connection's two shared-memory windows (the same-host zero-copy path).
- ``frame_writer`` — flow-controlled frame writes; ``auth`` — peer credentials, tenants,
  TLS; ``budget`` — the daemon-wide byte budget (backpressure).
- ``engine_calls`` — ``EngineCalls``: the engine as the server sees it, a typed ``Protocol``
  of the calls it makes (the server never imports ``daemon.engine``).
"""

from .listeners import Server

__all__ = ["Server"]
