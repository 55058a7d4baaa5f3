"""A connection's phases, as one table shared by both ends: the daemon's
``daemon.server.connection`` and the SDK's ``clients.transport`` (h11's ``_state.py``: every
rule of the state machine lives here; an illegal transition raises).

    phase       what flows on the connection
    HANDSHAKE   HELLO and its answer only (HELLO_OK, or an error frame and the end)
    OPEN        requests and their answers, PING / PONG
    DRAINING    the client said GOODBYE: the daemon answers what it received, reads nothing
                new, and closes once idle
    STOPPING    the daemon shuts down: nothing new is read, what runs goes on until the
                daemon closes the connection
    FAILED      a connection-level error (request id 0) was sent or received: nothing more is
                served; the daemon drops what it still reads, then closes
    CLOSING     this end said its last word (GOODBYE) and closes its transport, flushing
    CLOSED      the transport is gone

- ``Event``: ``ADMIT`` (the HELLO accepted: HELLO_OK sent or received), ``GOODBYE`` (the
  client's, received by the daemon), ``STOP`` (the daemon stops accepting), ``FAIL`` (a
  connection-level error), ``CLOSE`` (this end closes: the daemon's ``close(reason)``, the
  client's ``close()``), ``LOSE`` (the transport went away).
- ``TRANSITIONS``: (phase, event) → the next phase; what is not in it is illegal.
- ``ConnectionPhase``: one connection's phase; ``advance(event)`` moves it or raises
  ``IllegalTransition`` (a ``ProtocolError``); ``may(event)`` asks; ``reads_requests``,
  ``is_draining``, ``is_failed``, ``drops_input``, ``is_closing`` and ``is_gone`` are what the ends read in
  place of booleans of their own. Each end uses the events that happen to it: the client
  never drains or stops (a daemon's GOODBYE or error fails it).
"""

from __future__ import annotations

import enum

from .errors import IllegalTransition

__all__ = ["TRANSITIONS", "ConnectionPhase", "Event", "Phase"]


class Phase(enum.Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    DRAINING = "draining"
    STOPPING = "stopping"
    FAILED = "failed"
    CLOSING = "closing"
    CLOSED = "closed"


class Event(enum.Enum):
    ADMIT = "admit"
    GOODBYE = "goodbye"
    STOP = "stop"
    FAIL = "fail"
    CLOSE = "close"
    LOSE = "lose"


_P, _E = Phase, Event

#: (phase, event) → the next phase. A self-loop is an event that may repeat harmlessly (a
#: second error after the first, a shutdown reaching a connection already on its way out).
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (_P.HANDSHAKE, _E.ADMIT): _P.OPEN,
    (_P.HANDSHAKE, _E.STOP): _P.STOPPING,
    (_P.HANDSHAKE, _E.FAIL): _P.FAILED,
    (_P.HANDSHAKE, _E.CLOSE): _P.CLOSING,
    (_P.OPEN, _E.GOODBYE): _P.DRAINING,
    (_P.OPEN, _E.STOP): _P.STOPPING,
    (_P.OPEN, _E.FAIL): _P.FAILED,
    (_P.OPEN, _E.CLOSE): _P.CLOSING,
    (_P.DRAINING, _E.STOP): _P.DRAINING,  # it closes itself once idle, as it would have
    (_P.DRAINING, _E.FAIL): _P.FAILED,
    (_P.DRAINING, _E.CLOSE): _P.CLOSING,
    (_P.STOPPING, _E.STOP): _P.STOPPING,
    (_P.STOPPING, _E.FAIL): _P.FAILED,
    (_P.STOPPING, _E.CLOSE): _P.CLOSING,
    (_P.FAILED, _E.STOP): _P.FAILED,
    (_P.FAILED, _E.FAIL): _P.FAILED,
    (_P.FAILED, _E.CLOSE): _P.CLOSING,
    (_P.CLOSING, _E.STOP): _P.CLOSING,
    (_P.CLOSING, _E.FAIL): _P.CLOSING,
    (_P.CLOSING, _E.CLOSE): _P.CLOSING,
    **{(phase, _E.LOSE): _P.CLOSED for phase in Phase if phase is not _P.CLOSED},
}


class ConnectionPhase:
    """One connection's phase; see the module docstring."""

    __slots__ = ("phase",)

    def __init__(self, phase: Phase = Phase.HANDSHAKE) -> None:
        self.phase = phase

    def may(self, event: Event) -> bool:
        return (self.phase, event) in TRANSITIONS

    def advance(self, event: Event) -> Phase:
        """Take ``event``: the phase it leads to, or ``IllegalTransition``."""
        try:
            self.phase = TRANSITIONS[(self.phase, event)]
        except KeyError:
            raise IllegalTransition(f"{event.value} is not allowed in the {self.phase.value} phase") from None
        return self.phase

    @property
    def reads_requests(self) -> bool:
        """Whether a frame read now is taken (the HELLO, then requests)."""
        return self.phase is Phase.HANDSHAKE or self.phase is Phase.OPEN

    @property
    def is_open(self) -> bool:
        return self.phase is Phase.OPEN

    @property
    def is_draining(self) -> bool:
        return self.phase is Phase.DRAINING

    @property
    def is_failed(self) -> bool:
        return self.phase is Phase.FAILED

    @property
    def drops_input(self) -> bool:
        """Whether bytes read now are dropped undecoded: after a connection-level error, and
        once this end closes (nothing it reads then is answered)."""
        return self.phase is Phase.FAILED or self.phase is Phase.CLOSING

    @property
    def is_closing(self) -> bool:
        return self.phase is Phase.CLOSING

    @property
    def is_gone(self) -> bool:
        return self.phase is Phase.CLOSED

    def __repr__(self) -> str:
        return f"ConnectionPhase({self.phase.value})"
