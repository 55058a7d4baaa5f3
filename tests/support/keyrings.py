"""Keyrings on disk for tests that start several daemons sharing one.

- ``keyring_file(prefix, mode)`` — a ``with`` block: a fresh keyring saved as
  ``keyring.json`` in a new ``short_folder(prefix, mode)`` (daemons may put their folders
  beside it), removed with all it holds after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from statetier.protocol.keyring import Keyring
from tests.support.folders import short_folder


@contextmanager
def keyring_file(prefix: str = "st-keys-", mode: int | None = None) -> Iterator[Path]:
    """See the module docstring."""
    with short_folder(prefix, mode) as directory:
        path = directory / "keyring.json"
        Keyring.generate().save(path)
        yield path
