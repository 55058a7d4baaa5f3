"""Helpers that tests run as processes of their own (a crash writer, a worker under another uid).

- ``REPO`` — the root of this checkout.
- ``module_command(module, *args)`` — the argv of ``python -m module args…`` on this
  interpreter. Run it with ``cwd=REPO``: ``-m`` puts the working directory first on the
  child's path, so ``tests.support`` and ``statetier`` import from this checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_command(module: str, *args: object) -> list[str]:
    """See the module docstring."""
    return [sys.executable, "-m", module, *(str(arg) for arg in args)]
