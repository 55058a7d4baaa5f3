"""Compare the running environment with the lock (requirements/lock.txt).

    python scripts/lock_diff.py [LOCK] [--check]

Reads the lock's ``name==version ; marker`` lines (uv's universal format), keeps those whose
marker holds for this interpreter and platform, and compares them with the distributions
installed here (``importlib.metadata``). Prints one line:

- ``environment matches the lock (N packages)``, or
- ``differs from the lock (N): transformers 5.25.0 -> 5.26.0, foo (not locked) 1.2, bar 3.4 -> absent``

``--name PKG`` (repeatable) adds ``; PKG VERSION`` for each, as installed here.
``--check`` exits 1 when anything differs (``make venv`` uses it: the test venv is exactly
the lock); without it the line is information (``make test-latest`` ends with it).
The project itself (statetier) and pip are not part of the lock.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.markers import Marker
from packaging.utils import canonicalize_name

NOT_LOCKED = {"statetier", "pip"}
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)==(?P<version>[^\s;]+)\s*(?:;\s*(?P<marker>.+))?$")


def locked(path: Path) -> dict[str, str]:
    """The lock's pins that apply here, by canonical name."""
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "-")):
            continue
        match = _PIN.match(line)
        if match is None:
            raise SystemExit(f"{path}: not a pin: {line!r}")
        marker = match["marker"]
        if marker is None or Marker(marker).evaluate():
            pins[canonicalize_name(match["name"])] = match["version"]
    return pins


def installed() -> dict[str, str]:
    found = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            found[canonicalize_name(name)] = dist.version
    return {name: version for name, version in found.items() if name not in NOT_LOCKED}


def differences(pins: dict[str, str], have: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(set(pins) | set(have)):
        want, got = pins.get(name), have.get(name)
        if want == got:
            continue
        if want is None:
            out.append(f"{name} (not locked) {got}")
        elif got is None:
            out.append(f"{name} {want} -> absent")
        else:
            out.append(f"{name} {want} -> {got}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lock", nargs="?", default=str(Path(__file__).resolve().parent.parent
                                                       / "requirements" / "lock.txt"))
    parser.add_argument("--check", action="store_true", help="exit 1 when the environment differs")
    parser.add_argument("--name", action="append", default=[], help="also print this package's version")
    args = parser.parse_args(argv)
    pins, have = locked(Path(args.lock)), installed()
    diff = differences(pins, have)
    named = "".join(f"; {name} {have.get(canonicalize_name(name), 'absent')}" for name in args.name)
    if not diff:
        print(f"environment matches the lock ({len(pins)} packages){named}")
        return 0
    print(f"differs from the lock ({len(diff)}): {', '.join(diff)}{named}")
    if args.check:  # pip installs what the lock pins, but removes nothing it no longer names
        print(f"this environment ({sys.prefix}) is not the locked set: remove it and run make venv again",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
