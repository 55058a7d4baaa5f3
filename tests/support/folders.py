"""Short folders for tests whose processes bind Unix sockets (``AF_UNIX`` paths are short).

- ``short_folder(prefix, mode)`` — a ``with`` block: a new directory under ``/tmp`` (not
  pytest's long ``tmp_path``), given ``mode`` when set, removed with all it holds after.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def short_folder(prefix: str = "st-", mode: int | None = None) -> Iterator[Path]:
    """See the module docstring."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        if mode is not None:
            directory.chmod(mode)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
