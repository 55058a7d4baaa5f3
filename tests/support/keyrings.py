"""Keyrings on disk for tests that start several daemons sharing one.

- ``keyring_file(prefix, mode)`` — a ``with`` block: a fresh keyring saved as
  ``keyring.json`` in a new directory under ``/tmp`` (short: daemons put their sockets in
  folders beside it), the directory given ``mode`` when set; removed with all it holds after.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from statetier.protocol.keyring import Keyring


@contextmanager
def keyring_file(prefix: str = "st-keys-", mode: int | None = None) -> Iterator[Path]:
    """See the module docstring."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        if mode is not None:
            directory.chmod(mode)
        path = directory / "keyring.json"
        Keyring.generate().save(path)
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)
