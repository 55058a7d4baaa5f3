"""KV events: what the daemon stores, evicts, deletes and purges, per tier, in vLLM's format.

- ``EventPublisher`` (``publisher``) — the event-loop side: the sink of the engine's
  ``daemon.engine.announcements``; batches per loop iteration; never waits.
- ``Streams`` (``streams``) — the publisher thread: each tenant's XPUB and replay (ROUTER)
  sockets, the replay ring, the counts.

The wire format is ``statetier.protocol.kv_events``; the configuration ``[events]``
(``daemon.config_events``); how routers read it, docs/integration.md.
"""

from .publisher import EventPublisher

__all__ = ["EventPublisher"]
