"""How a batch call is cut into batch frames, and how an item's error names its place.

- ``batches_of(items, max_bytes, size_of)`` → consecutive runs of at most ``BATCH_ITEMS``
  items and ``max_bytes`` (by ``size_of(item)``; a bigger item goes alone), in order.
- ``pairs_bytes(pairs)`` — the payload bytes of a put's ``[(name, tensor)]`` (an upper bound:
  each tensor's bytes plus its alignment padding).
- ``with items_from(offset):`` — a batch item's error (``detail["item"]``, its position in
  its frame) is shifted by ``offset`` to its position in the whole call.

Used by ``AsyncClient.put_many`` / ``load_many``.
"""

from __future__ import annotations

import contextlib

from statetier.protocol.errors import StatetierError

BATCH_ITEMS = 64


def batches_of(items: list, max_bytes: int, size_of) -> list[list]:
    """Consecutive runs of at most ``BATCH_ITEMS`` items and ``max_bytes`` (a bigger item
    goes alone)."""
    batches: list[list] = []
    current: list = []
    nbytes = 0
    for item in items:
        size = size_of(item)
        if current and (len(current) >= BATCH_ITEMS or nbytes + size > max_bytes):
            batches.append(current)
            current, nbytes = [], 0
        current.append(item)
        nbytes += size
    if current:
        batches.append(current)
    return batches


def pairs_bytes(pairs) -> int:
    return sum(t.numel() * t.element_size() + 64 for _, t in pairs)


@contextlib.contextmanager
def items_from(offset: int):
    """A batch item's error names its position in the whole call, not in its frame."""
    try:
        yield
    except StatetierError as exc:
        if isinstance(exc.detail.get("item"), int):
            exc.detail["item"] += offset
        raise
