"""Loading the configuration: defaults ← TOML file ← environment ← overrides, validated once.

- ``load_config(path, env, overrides)`` — embedded defaults ← TOML file (``path``, else
  ``$STATETIER_CONFIG``) ← environment ``STATETIER_<SECTION>__<FIELD>`` / ``STATETIER_<FIELD>``
  ← overrides (dotted keys, ``"disk.directory"``). Raises ``ConfigError`` naming the
  field path and where the bad value came from (which file, variable or override).
- ``parse_env_value`` / ``parse_setting(dotted, raw)`` — how an environment string (or a
  ``--set KEY=VALUE``) becomes a value: JSON when it parses; text fields, and file modes
  (``"660"`` is octal, never the decimal 660), keep the raw string.

With ``daemon.config`` (the model), the only reader of the daemon's environment (the client
commands' ``$STATETIER_URL``/``$STATETIER_TOKEN``: ``daemon.client_env``). Called by
``statetier serve`` and ``--set`` in ``daemon/cli/serve.py``.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ValidationError

from statetier.daemon.config import Config
from statetier.daemon.config_values import parse_mode
from statetier.protocol.errors import ConfigError

ENV_PREFIX = "STATETIER_"
ENV_CONFIG_FILE = "STATETIER_CONFIG"
#: STATETIER_* variables that are not settings: the clients' (``daemon.client_env``), the
#: container build's and the test tooling's. Any other unknown one is refused, as an unknown
#: TOML key is: a misspelt setting must not be ignored.
ENV_NOT_CONFIG = frozenset({"STATETIER_CONFIG", "STATETIER_URL", "STATETIER_TOKEN", "STATETIER_DEPS",
                            "STATETIER_REDIS_SERVER", "STATETIER_REDIS_CLI"})


def load_config(
    path: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Defaults ← TOML ← environment ← overrides, validated once; ``ConfigError`` on any problem."""
    env = os.environ if env is None else env
    merged: dict = {}
    sources: dict[tuple, str] = {}
    if path is None and env.get(ENV_CONFIG_FILE):
        path = env[ENV_CONFIG_FILE]
    if path is not None:
        _merge(merged, sources, _read_toml(Path(path)), (), f"config file {path}")
    for name, path_keys, value in _env_entries(env):
        _merge(merged, sources, _nest(path_keys, value), (), f"environment {name}")
    for dotted, value in (overrides or {}).items():
        keys = tuple(part for part in dotted.split(".") if part)
        if not keys:
            raise ConfigError(f"override {dotted!r}: empty key")
        _merge(merged, sources, _nest(keys, value), (), f"override {dotted}")
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, sources)) from exc


def parse_setting(dotted: str, raw: str) -> object:
    """A text value for the field at ``dotted`` ("disk.fsync"), read as the environment is."""
    keys = tuple(part for part in dotted.split(".") if part)
    return parse_env_value(raw, _annotation_at(keys), is_mode=_is_mode_at(keys))


def parse_env_value(raw: str, annotation: object = None, *, is_mode: bool = False) -> object:
    """JSON when it parses (numbers, booleans, lists, objects), else the raw string.

    Text fields (``str``/``Path``) keep the raw string, so ``STATETIER_PRODUCER_ID=42``
    stays ``"42"``; ``null`` still clears an optional field. A file mode (``is_mode``)
    keeps it too: ``660`` is read as octal, not as JSON's decimal.
    """
    if is_mode:
        return raw
    kinds = _leaf_types(annotation)
    if kinds and kinds <= {str, Path, type(None)}:
        return None if raw == "null" and type(None) in kinds else raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc


def _env_entries(env: Mapping[str, str]):
    """``STATETIER_DISK__DIRECTORY`` → ("disk", "directory"); single-level names only when
    they are ``Config`` fields; ``ENV_NOT_CONFIG`` are skipped, any other is refused."""
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE:
            continue
        keys = tuple(part.lower() for part in name[len(ENV_PREFIX):].split("__"))
        if len(keys) == 1 and keys[0] not in Config.model_fields:
            if name in ENV_NOT_CONFIG:
                continue
            raise ConfigError(_unknown_variable(name))
        if any(not part for part in keys):
            raise ConfigError(f"environment {name}: empty name segment")
        yield name, keys, parse_env_value(env[name], _annotation_at(keys), is_mode=_is_mode_at(keys))


def _unknown_variable(name: str) -> str:
    settings = [ENV_PREFIX + field.upper() for field in Config.model_fields]
    close = difflib.get_close_matches(name, settings, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (f"environment {name}: no such setting{hint}; sections take two underscores "
            f"(STATETIER_<SECTION>__<FIELD>, e.g. STATETIER_REDIS__URL)")


def _annotation_at(keys: tuple[str, ...]) -> object:
    model: object = Config
    annotation: object = None
    for key in keys:
        fields = getattr(model, "model_fields", None)
        if not fields or key not in fields:
            return None
        annotation = fields[key].annotation
        model = next((t for t in _leaf_types(annotation) if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return annotation


def _is_mode_at(keys: tuple[str, ...]) -> bool:
    model: object = Config
    for key in keys[:-1]:
        fields = getattr(model, "model_fields", None)
        if not fields or key not in fields:
            return False
        model = next((t for t in _leaf_types(fields[key].annotation)
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
    fields = getattr(model, "model_fields", None) or {}
    info = fields.get(keys[-1]) if keys else None
    return info is not None and any(getattr(m, "func", None) is parse_mode for m in info.metadata)


def _leaf_types(annotation: object) -> set:
    if annotation is None:
        return set()
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _leaf_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_leaf_types(arg) for arg in typing.get_args(annotation)))
    if origin is Literal:
        return {str}
    return {origin or annotation}


def _nest(keys: tuple, value: object) -> dict:
    for key in reversed(keys):
        value = {key: value}
    return value  # type: ignore[return-value]


def _merge(into: dict, sources: dict, layer: Mapping, prefix: tuple, source: str) -> None:
    """Deep-merge ``layer`` into ``into``; ``sources`` records, per leaf path, who set it."""
    for key, value in layer.items():
        here = (*prefix, key)
        if isinstance(value, Mapping):
            if not isinstance(into.get(key), dict):
                into[key] = {}
                _forget(sources, here)
            _merge(into[key], sources, value, here, source)
        else:
            into[key] = value
            _forget(sources, here)
            sources[here] = source


def _forget(sources: dict, path: tuple) -> None:
    for old in [p for p in sources if p[: len(path)] == path]:
        del sources[old]


def _describe(exc: ValidationError, sources: dict[tuple, str]) -> str:
    lines = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or "config"
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {message} ({_source_of(loc, sources)})")
    return "; ".join(lines)


def _source_of(loc: tuple, sources: dict[tuple, str]) -> str:
    keys = tuple(str(part) for part in loc if not isinstance(part, int))
    for depth in range(len(keys), 0, -1):
        hit = sources.get(keys[:depth])
        if hit is not None:
            return f"from {hit}"
    # A default that conflicts with something set nearby: name what was set in its section.
    for depth in (len(keys), len(keys) - 1):
        near = sorted({s for p, s in sources.items() if p[:depth] == keys[:depth]}) if depth > 0 else []
        if near:
            return "from " + ", ".join(near)
    return "default"
