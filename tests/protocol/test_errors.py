"""The error tree: a complete, unique code↔class table that survives the wire."""

from __future__ import annotations

import inspect
import pickle
import re

import pytest

from statetier.protocol import errors
from statetier.protocol.errors import (
    ERRORS_BY_CODE,
    ClientClosedError,
    InternalError,
    RejectedState,
    StatetierError,
    error_from_code,
)

CLASSES = [
    obj for _, obj in inspect.getmembers(errors, inspect.isclass)
    if issubclass(obj, StatetierError) and obj.__module__ == errors.__name__
]


def _descendants(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_descendants(direct))]


def test_every_error_class_in_the_module_is_in_the_table():
    assert len(CLASSES) == 33  # the tree drawn in the module docstring
    assert sorted(ERRORS_BY_CODE.values(), key=lambda c: c.code) == sorted(CLASSES, key=lambda c: c.code)


def test_no_subclass_anywhere_collides_with_the_table():
    descendants = {StatetierError, *_descendants(StatetierError)}
    codes = [cls.code for cls in descendants]
    assert len(set(codes)) == len(codes), "a StatetierError subclass reuses a wire code"


def test_codes_are_unique_and_fit_u16():
    codes = [cls.code for cls in CLASSES]
    assert len(set(codes)) == len(codes), "two classes share a wire code"
    assert all(isinstance(c, int) and 0 < c <= 0xFFFF for c in codes)
    assert all(ERRORS_BY_CODE[cls.code] is cls for cls in CLASSES)


def test_every_class_declares_its_own_code_and_reason():
    for cls in CLASSES:
        assert "code" in vars(cls) and "reason" in vars(cls), cls.__name__


def test_reasons_are_unique_snake_case():
    reasons = [cls.reason for cls in CLASSES]
    assert len(set(reasons)) == len(reasons)
    assert all(re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", r) for r in reasons), reasons


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_error_from_code_round_trips(cls):
    exc = cls("the message", field="x")
    rebuilt = error_from_code(exc.code, exc.message)
    assert type(rebuilt) is cls
    assert rebuilt.message == "the message" and str(rebuilt) == "the message"
    assert rebuilt.code == cls.code and rebuilt.reason == cls.reason


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_errors_survive_pickling_for_executors(cls):
    exc = cls("boom", state_id="ab")
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is cls and copy.message == "boom" and copy.detail == {"state_id": "ab"}


@pytest.mark.parametrize("code", [0, 2, 98, 112, 199, 999, 65535, -1])
def test_unknown_code_becomes_internal_error(code):
    exc = error_from_code(code, "from a newer peer")
    assert type(exc) is InternalError
    assert str(code) in exc.message and "from a newer peer" in exc.message


def test_message_defaults_to_the_reason():
    assert str(errors.Busy()) == "busy" and errors.Busy().message == "busy"


def test_rejections_of_stored_state_are_codes_99_to_111():
    rejected = {cls.code for cls in CLASSES if issubclass(cls, RejectedState)}
    assert rejected == set(range(99, 112))


def test_documented_tree_matches_the_classes():
    documented = dict(
        (name, int(code)) for name, code in re.findall(r"[├└]── (\w+)\s+(\d+)", errors.__doc__)
    )
    assert documented == {cls.__name__: cls.code for cls in CLASSES if cls.__name__ in documented}
    assert set(documented) == {cls.__name__ for cls in CLASSES} - {"StatetierError", "RejectedState"}


def test_client_closed_is_programmer_misuse_not_a_wire_error():
    assert issubclass(ClientClosedError, RuntimeError)
    assert not issubclass(ClientClosedError, StatetierError)
    assert ClientClosedError not in ERRORS_BY_CODE.values()
