"""deploy/statetier.toml: generated from the Config model, loadable, and complete.

The example is what an operator copies to /etc/statetier/statetier.toml, so it must name
every option (active, or commented out with an example value), load with ``load_config``
as it is and with every commented-out option switched on, and differ from the embedded
defaults only where the generator says so (the systemd layout's paths).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from statetier.daemon.config import Config
from statetier.daemon.config_loading import load_config
from statetier.protocol.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "statetier.toml"
CONTAINER = REPO / "deploy" / "container" / "statetier.toml"
_KEY_LINE = re.compile(r"^(# )?([a-z][a-z0-9_]*) = ")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_example_config", REPO / "scripts" / "gen_example_config.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def all_fields(model: type[BaseModel] = Config, prefix: str = "") -> set[str]:
    """Dotted names of every leaf field; a tuple of models (tenants) counts as a section."""
    found = set()
    for name, info in model.model_fields.items():
        annotation = info.annotation
        args = typing.get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found |= all_fields(annotation, f"{prefix}{name}.")
        elif typing.get_origin(annotation) is tuple and args and isinstance(args[0], type) \
                and issubclass(args[0], BaseModel):
            found |= all_fields(args[0], f"{prefix}{name}.")
        else:
            found.add(prefix + name)
    return found


def named_fields(text: str) -> tuple[set[str], set[str]]:
    """(active, commented-out) dotted keys the example names; ``# e.g.`` lines are neither."""
    active, commented, section = set(), set(), ""
    for line in text.splitlines():
        header = re.match(r"^\[\[?([a-z_]+)\]\]?$", line)
        if header:
            section = header.group(1) + "."
            continue
        match = _KEY_LINE.match(line)
        if match:
            (commented if match.group(1) else active).add(section + match.group(2))
    return active, commented


def test_the_example_is_what_the_generator_writes_now() -> None:
    assert EXAMPLE.read_text() == _generator().render(), (
        "deploy/statetier.toml is out of date: run .venv/bin/python scripts/gen_example_config.py")


def test_the_example_names_every_field_exactly_once() -> None:
    active, commented = named_fields(EXAMPLE.read_text())
    assert not active & commented
    assert active | commented == all_fields()


def test_every_field_has_a_description_to_write_as_its_comment() -> None:
    def undescribed(model: type[BaseModel], prefix: str = "") -> list[str]:
        missing = []
        for name, info in model.model_fields.items():
            if not info.description:
                missing.append(prefix + name)
            args = typing.get_args(info.annotation)
            inner = info.annotation if isinstance(info.annotation, type) else (args[0] if args else None)
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                missing += undescribed(inner, f"{prefix}{name}.")
        return missing

    assert undescribed(Config) == []


def test_the_example_loads_and_differs_from_the_defaults_only_in_the_deployment_paths() -> None:
    loaded = load_config(EXAMPLE, env={})
    expected = load_config(None, env={}, overrides=_generator().DEPLOYMENT)
    assert loaded == expected
    assert str(loaded.listen.socket_path) == "/run/statetier/statetier.sock"
    assert str(loaded.disk.directory) == "/var/lib/statetier"


def test_every_commented_out_example_value_loads_too(tmp_path: Path) -> None:
    lines = EXAMPLE.read_text().splitlines()
    switched_on = [line[2:] if _KEY_LINE.match(line) and line.startswith("# ") else line for line in lines]
    full = tmp_path / "full.toml"
    full.write_text("\n".join(switched_on) + "\n")
    config = load_config(full, env={})
    assert config.redis.url.startswith("rediss://")
    assert config.listen.tcp == "0.0.0.0:7000" and config.listen.tls_client_ca is not None
    assert config.host.capacity_bytes == 8 << 30
    assert config.tenants[0].token_sha256 is not None


def test_a_typo_in_a_copied_example_names_the_field(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text(EXAMPLE.read_text().replace("segment_bytes = ", "segment_byte = "))
    with pytest.raises(ConfigError, match=r"disk\.segment_byte"):
        load_config(broken, env={})


def test_the_container_config_loads_with_the_container_layout() -> None:
    config = load_config(CONTAINER, env={})
    assert str(config.listen.socket_path) == "/run/statetier/statetier.sock"
    assert str(config.disk.directory) == "/var/lib/statetier"
    assert (config.metrics.host, config.metrics.port) == ("0.0.0.0", Config().metrics.port)
    assert config.host.capacity_bytes is not None  # never sized from the node's memory
