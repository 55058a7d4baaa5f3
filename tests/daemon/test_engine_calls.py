"""The server sees the engine as ``EngineCalls``; ``Engine`` answers every one of those calls."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from statetier.daemon.engine import Engine
from statetier.daemon.server.engine_calls import EngineCalls

SERVER = Path(__file__).resolve().parents[2] / "daemon" / "server"


def declared(cls: type) -> dict[str, object]:
    return {name: member for name, member in vars(cls).items() if not name.startswith("_")}


def shape(function) -> list[tuple[str, object, object]]:
    """Parameter names, kinds and defaults (the annotations are the Protocol's to state)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_engine_has_every_call_of_the_protocol_with_the_same_parameters() -> None:
    calls = declared(EngineCalls)
    assert len(calls) == 12
    for name, call in calls.items():
        mine = getattr(Engine, name)
        assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(call), name
        assert shape(mine) == shape(call), name
    assert "executor" in EngineCalls.__annotations__


def test_the_server_calls_nothing_else_on_the_engine() -> None:
    used = set()
    for path in SERVER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr in ("engine", "_engine")) \
                    or (isinstance(owner, ast.Name) and owner.id == "engine"):
                used.add(node.attr)
    assert used and used <= set(declared(EngineCalls)) | {"executor"}, used - set(declared(EngineCalls))
