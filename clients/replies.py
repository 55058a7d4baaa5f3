"""What the daemon answered a hot op, read on the client side (``protocol.wire_meta``).

- ``decoded(cls, frame)`` — a REPLY's binary meta as ``cls`` (``MalformedFrame`` otherwise).
- ``stored_ref(answer)`` — a ``PutAnswer`` as the ``StoredRef`` a put returns.
- ``batch_answers(reply, expected, raise_first=True)`` — a batch reply's answers, one per
  item (``MalformedFrame`` otherwise); with ``raise_first`` the first item error is raised
  (``raise_item_error``: its position in ``detail["item"]``), and a skip without a failure
  before it is ``MalformedFrame``.
- ``record(trace, answer, request=, client_copy=)`` — a frame's phase timings in µs added
  to a call's: its round trip, the client's copy, and the daemon's own phases (``daemon_*``).
- ``once(fn)`` — ``fn`` at most once, whichever cleanup path gets there first.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from msgspec import Struct


from statetier.protocol.errors import MalformedFrame, error_from_code
from statetier.protocol.frames import Frame
from statetier.protocol.wire_meta import ErrorInfo, PutAnswer, decode_reply, ref_of

from .values import StoredRef

S = TypeVar("S", bound=Struct)


def decoded(cls: type[S], frame: Frame) -> S:
    if not frame.is_binary:
        raise MalformedFrame(f"the daemon answered with a JSON meta where a {cls.__name__} was due")
    return decode_reply(cls, frame.meta)


def stored_ref(answer: PutAnswer) -> StoredRef:
    if answer.ref is None:
        raise MalformedFrame("a PUT reply without a ref")
    ref = ref_of(answer.ref)
    return StoredRef(ref.key, ref.request_id, ref.step, ref.state_id, ref.version, ref.fingerprint,
                     tier=answer.tier, published=answer.published, durable=answer.durable)


def batch_answers(items: tuple, expected: int, *, raise_first: bool = True) -> tuple:
    if len(items) != expected:
        raise MalformedFrame(f"a batch reply must answer each of its {expected} items, not {len(items)}")
    if raise_first:
        for index, answer in enumerate(items):
            if answer.error is not None:
                raise_item_error(index, answer.error)
            if answer.skipped:
                raise MalformedFrame("a batch reply skipped an item without a failure before it")
    return items


def raise_item_error(index: int, error: ErrorInfo) -> None:
    """Raise a batch item's error, its position in the batch in ``detail["item"]``."""
    exc = error_from_code(error.code, error.message)
    exc.detail["item"] = index
    raise exc


def record(trace: dict | None, answer, *, request: float, client_copy: tuple | None = None) -> None:
    """Add to ``trace`` (µs): the client's copy, the round trip, and the daemon's own phases
    (summed over the frames of a call that sends several)."""
    if trace is None:
        return
    phases = {"round_trip": (time.perf_counter() - request) * 1e6}
    if client_copy is not None:
        phases["client_copy"] = (client_copy[1] - client_copy[0]) * 1e6
    if answer.trace:
        phases.update({f"daemon_{name}": value for name, value in answer.trace.items()})
    for name, value in phases.items():
        trace[name] = trace.get(name, 0.0) + value


def once(fn: Callable[[], None]) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()
    return call


__all__ = ["batch_answers", "decoded", "once", "raise_item_error", "record", "stored_ref"]
