"""The value types of configuration fields: sizes with units, octal file modes, host:port.

- ``parse_size(value)``: ``"64MiB"`` → 67108864 (binary K/KiB…, decimal KB/MB…); other
  values pass through for pydantic to judge. ``KiB``, ``MiB``, ``GiB``, ``TiB``.
- ``Bytes``: a positive int field that also accepts a size string; ``Seconds``: a positive float.
- ``parse_mode(value)``: ``"660"`` / ``"0o660"`` → 0o660 (file modes are octal); an int
  above 0o777 (TOML's ``660`` is decimal, 0o1224) is refused, naming the octal spelling.
  ``FileMode``: such a field; the environment and ``--set`` pass it as text
  (``daemon.config_loading``), and it is written back in octal (``"0o660"``).
- ``split_host_port(text)``: ``"127.0.0.1:7000"`` / ``"[::1]:7000"`` → (host, port).
- ``TIER_NAMES``; ``known_tiers(by_tier)``: a mapping keyed by tier names, checked.

Used by the section models of ``daemon.config``, by ``daemon.server.listeners`` (the TCP address)
and by ``scripts/gen_example_config.py``; raise ``ValueError`` so that pydantic names the field.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, Field, PlainSerializer

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB, "t": TiB, "tib": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> object:
    """``"64MiB"`` → 67108864 (binary: K/KiB…, decimal: KB/MB…); other values pass through."""
    if not isinstance(value, str):
        return value
    match = _SIZE.match(value.replace("_", ""))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use bytes or a unit: 512MiB, 2GiB, 10GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


Bytes = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]
Seconds = Annotated[float, Field(gt=0)]


def parse_mode(value: object) -> object:
    if isinstance(value, str):  # "660", "0660", "0o660": file modes are octal
        text = value.strip().lower().removeprefix("0o")
        if not re.fullmatch(r"[0-7]{1,3}", text.lstrip("0") or "0"):
            raise ValueError(f"not an octal file mode (0 to 777): {value!r}")
        return int(text, 8)
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= 0o777:
        spelled = f"; if you meant octal {value}, write 0o{value} (TOML) or \"{value}\" (text)" \
            if re.fullmatch(r"[0-7]{1,3}", str(value)) else ""
        raise ValueError(f"{value} is not a file mode (0 to 0o777){spelled}")
    return value


def octal_mode(value: int) -> str:
    return f"0o{value:o}"


FileMode = Annotated[int, BeforeValidator(parse_mode), PlainSerializer(octal_mode, return_type=str)]

TIER_NAMES = ("device", "host", "disk", "redis")


def known_tiers(by_tier: dict) -> dict:
    """``by_tier`` when every key names a tier (``TIER_NAMES``), else ``ValueError``."""
    unknown = sorted(set(by_tier) - set(TIER_NAMES))
    if unknown:
        raise ValueError(f"unknown tier {unknown[0]!r}; tiers are {', '.join(TIER_NAMES)}")
    return by_tier


def split_host_port(text: str) -> tuple[str, int]:
    """``"127.0.0.1:7000"`` / ``"[::1]:7000"`` → (host, port); ValueError otherwise."""
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]\s]+):(\d+)", text.strip())
    if match is None:
        raise ValueError(f'expected "host:port", got {text!r}')
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if port > 65535:
        raise ValueError(f"port {port} is out of range")
    return host, port
