"""Issue 36: a connection's phases are one table (``protocol.phases``), walked here whole.

Every (phase, event) pair either leads where the table says or raises ``IllegalTransition``
(a ``ProtocolError`` with its own wire code) and leaves the phase as it was; every phase is
reached from the handshake; every phase but CLOSED ends in CLOSED when the transport goes;
nothing leaves CLOSED. The lifecycles both ends live are walked as stories.
"""

from __future__ import annotations

import pytest

from statetier.protocol.errors import ERRORS_BY_CODE, IllegalTransition, ProtocolError
from statetier.protocol.phases import TRANSITIONS, ConnectionPhase, Event, Phase


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
def test_every_event_in_every_phase_moves_by_the_table_or_raises_and_stays(phase: Phase) -> None:
    for event in Event:
        state = ConnectionPhase(phase)
        assert state.may(event) == ((phase, event) in TRANSITIONS)
        if (phase, event) in TRANSITIONS:
            assert state.advance(event) is TRANSITIONS[(phase, event)] is state.phase
        else:
            with pytest.raises(IllegalTransition):
                state.advance(event)
            assert state.phase is phase


def test_every_phase_is_reached_from_the_handshake_and_ends_closed() -> None:
    reached, frontier = {Phase.HANDSHAKE}, [Phase.HANDSHAKE]
    while frontier:
        phase = frontier.pop()
        for (source, _), target in TRANSITIONS.items():
            if source is phase and target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(Phase)
    assert all(TRANSITIONS[(phase, Event.LOSE)] is Phase.CLOSED for phase in Phase if phase is not Phase.CLOSED)
    assert [event for (source, event) in TRANSITIONS if source is Phase.CLOSED] == []


def walk(*events: Event) -> list[Phase]:
    state = ConnectionPhase()
    return [state.advance(event) for event in events]


def test_the_lifecycles_of_both_ends() -> None:
    # the daemon: a client's GOODBYE drains; a shutdown stops, then closes; a bad frame fails
    assert walk(Event.ADMIT, Event.GOODBYE, Event.LOSE) == [Phase.OPEN, Phase.DRAINING, Phase.CLOSED]
    assert walk(Event.ADMIT, Event.STOP, Event.CLOSE, Event.LOSE) == [
        Phase.OPEN, Phase.STOPPING, Phase.CLOSING, Phase.CLOSED]
    assert walk(Event.FAIL, Event.STOP, Event.CLOSE, Event.LOSE) == [
        Phase.FAILED, Phase.FAILED, Phase.CLOSING, Phase.CLOSED]
    # the client: close() says GOODBYE; the daemon's GOODBYE or error fails it
    assert walk(Event.ADMIT, Event.CLOSE, Event.LOSE) == [Phase.OPEN, Phase.CLOSING, Phase.CLOSED]
    assert walk(Event.ADMIT, Event.FAIL, Event.LOSE) == [Phase.OPEN, Phase.FAILED, Phase.CLOSED]


def test_what_each_phase_lets_an_end_do() -> None:
    rows = {phase: (state.reads_requests, state.is_draining, state.drops_input, state.is_gone)
            for phase in Phase for state in [ConnectionPhase(phase)]}
    assert rows == {
        Phase.HANDSHAKE: (True, False, False, False),
        Phase.OPEN: (True, False, False, False),
        Phase.DRAINING: (False, True, False, False),
        Phase.STOPPING: (False, False, False, False),
        Phase.FAILED: (False, False, True, False),
        Phase.CLOSING: (False, False, True, False),
        Phase.CLOSED: (False, False, False, True),
    }


def test_an_illegal_transition_is_a_typed_protocol_error_with_its_own_code() -> None:
    with pytest.raises(IllegalTransition) as raised:
        walk(Event.GOODBYE)  # no GOODBYE before the handshake
    assert isinstance(raised.value, ProtocolError) and ERRORS_BY_CODE[404] is IllegalTransition
    assert raised.value.reason == "illegal_transition"
