"""What the KV event stream tells routers: an object's arrival in and departure from each tier.

``Announcements(sink, media)`` — built by ``Engine`` when KV events are on, and made the
``Tenancy`` observer: every copy of an object the daemon charges to a tier is a
``BlockStored`` for that tier's medium, every charge given back (an eviction, a delete, a
purge, a damaged copy dropped) a ``BlockRemoved``. Charges follow every path a copy takes (a
put, write-behind, publish, demotion, promotion; ``daemon.engine.tenancy``), so the events do
too, in the order the daemon made them.

- ``record_put(req, meta)`` — before a put's first charge: the block the events will name,
  the tag its client attached (``protocol.kv_events.BlockTag``) or else the key's prefix hash,
  with the key's span as the block size; its tenant and namespace pick the stream and topic.
- ``charged(tenant, tier, state_id)`` / ``refunded(tenant, tier, state_id)`` — the observer's calls.
- ``sink.emit(tenant, namespace, event)`` — never waits (``daemon.events.EventPublisher``).

An object the daemon did not see put since it started (found on disk or in Redis after a
restart) has no record: it is never announced, so its departure is not either, and a
router's view stays what it was told. A record lives while any tier holds a charged copy; its
tokens take 4 bytes each, at most the key's span of them (``daemon.engine.puts`` refuses more).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from statetier.protocol.kv_events import BlockRemoved, BlockStored, Hash
from statetier.tiers.base import ObjectMeta

from ..requests import PutRequest

_NO_TOKENS = array("I")


@dataclass(slots=True)
class _Record:
    namespace: bytes
    hashes: tuple[Hash, ...]
    parent: Hash | None
    tokens: array  # 4 bytes a token: a put's tag holds at most its key's span of them
    block_size: int
    tiers: int = 0  # tiers holding a charged copy


class Announcements:
    def __init__(self, sink, media: dict[str, str]) -> None:
        self.sink = sink
        self.media = dict(media)
        self._records: dict[bytes, _Record] = {}

    def record_put(self, req: PutRequest, meta: ObjectMeta) -> None:
        key, tag = req.key, req.tag
        span = key.token_end - key.token_start
        if tag is None:
            self._records[meta.object_id] = _Record(key.namespace.digest, (key.prefix_hash,), None, _NO_TOKENS, span)
        else:
            self._records[meta.object_id] = _Record(key.namespace.digest, (tag.hash,), tag.parent,
                                                    array("I", tag.tokens), span)

    def charged(self, tenant: str, tier: str, state_id: bytes) -> None:
        record = self._records.get(state_id)
        if record is None:
            return
        record.tiers += 1
        self.sink.emit(tenant, record.namespace, BlockStored(record.hashes, record.parent, tuple(record.tokens),
                                                             record.block_size, self._medium(tier)))

    def refunded(self, tenant: str, tier: str, state_id: bytes) -> None:
        record = self._records.get(state_id)
        if record is None:
            return
        record.tiers -= 1
        if record.tiers <= 0:
            del self._records[state_id]
        self.sink.emit(tenant, record.namespace, BlockRemoved(record.hashes, self._medium(tier)))

    def _medium(self, tier: str) -> str:
        return self.media.get(tier, tier.upper())

    def __len__(self) -> int:
        return len(self._records)
