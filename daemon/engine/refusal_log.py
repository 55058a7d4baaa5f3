"""Refused objects said at INFO, once per reason per interval (``statetier.daemon.refusals``).

``RefusalLog(interval=REFUSAL_LOG_INTERVAL, clock=time.monotonic)`` — one per engine, in its
``Stack``; ``note(exc, state_id=None)`` is called with every counted rejection
(``Stack.count_rejection``, beside ``statetier_rejections_total{reason}``):

- the first refusal of a reason logs one line: the reason, the object (its state id, hex) and
  the error's message;
- later ones of that reason within ``interval`` seconds are only counted, and the next line
  of the reason says how many were not logged (``N more since``).

So a flood of one reason (a rotated-away key, a bad disk) costs one line a minute per
reason; the metric counts each one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from statetier.protocol.errors import StatetierError

REFUSAL_LOG_INTERVAL = 60.0  # seconds between two lines of one reason

log = logging.getLogger("statetier.daemon.refusals")


class RefusalLog:
    def __init__(self, interval: float = REFUSAL_LOG_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}  # reason -> when its last line was logged
        self._held: dict[str, int] = {}  # reason -> refusals since, not logged

    def note(self, exc: StatetierError, state_id: bytes | None = None) -> bool:
        """Log ``exc`` unless its reason was logged within ``interval``; whether it was."""
        now, reason = self._clock(), exc.reason
        last = self._last.get(reason)
        if last is not None and now - last < self.interval:
            self._held[reason] = self._held.get(reason, 0) + 1
            return False
        self._last[reason] = now
        held = self._held.pop(reason, 0)
        since = f" ({held} more of this reason since the last line)" if held else ""
        log.info("refused object %s: %s: %s%s", state_id.hex() if state_id else "(id not known)", reason,
                 exc.message, since)
        return True
