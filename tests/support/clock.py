"""A clock a test drives by hand, for the tiers' ``clock`` option (``tiers.base.Clock``).

- ``ManualClock(start)`` — ``clock()`` reads the time it was set to; ``advance(seconds)``
  moves it on. Lease deadlines then pass when the test says so, not after a sleep.
"""

from __future__ import annotations


class ManualClock:
    """See the module docstring."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now += seconds
