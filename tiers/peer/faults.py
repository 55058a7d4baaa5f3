"""The peer tier's faults, counted and said: what an operator sees of a network between daemons.

``PeerFaults`` — ``count(reason, message, *args)`` adds one to ``reason`` (one of ``REASONS``)
and logs ``message`` at WARNING on ``statetier.peer`` (the owner's address, what happened,
what happens next); ``snapshot()`` is every reason's count (all present, at 0 from the
start), read at scrape time as ``statetier_peer_faults_total{reason}``. Reasons:

    redialled        a pooled connection was found closed; the pull dialled a fresh one
    retried          a pull broken off on a fresh connection was tried again, after a backoff
    suspected        a pull failed within its deadline; the owner renews its liveness key: not fenced
    fenced_gone      an owner's liveness key expired: its entries are no longer offered here
    fenced_refused   an owner's address refused the connection (no process listens there)
    fenced_replaced  another owner id answers at an owner's address (the daemon restarted)
    unfenced         a fenced owner renewed its liveness key again: its entries are offered again
    reannounced      the directory came back without this daemon's entries: they were published again
    renewal_failed   the liveness key could not be renewed (the directory unreachable)
"""

from __future__ import annotations

import logging

log = logging.getLogger("statetier.peer")

REASONS = ("redialled", "retried", "suspected", "fenced_gone", "fenced_refused", "fenced_replaced", "unfenced",
           "reannounced", "renewal_failed")


class PeerFaults:
    def __init__(self) -> None:
        self._counts = dict.fromkeys(REASONS, 0)

    def count(self, reason: str, message: str, *args: object) -> None:
        self._counts[reason] += 1  # KeyError on an undeclared reason: the label set stays bounded
        log.warning(message, *args)

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def __getitem__(self, reason: str) -> int:
        return self._counts[reason]
