"""Progress of a long command, on a terminal only: ``TerminalProgress(desc, unit="it", stream=None)``.

``progress(done, total)`` moves it, ``close()`` ends its line. On a terminal
(``stream.isatty()``, stderr by default) it is a tqdm bar when tqdm is installed (the
``bench`` extra), else one rewritten line; into a file or a pipe it writes nothing, so a log
or a CI transcript carries no carriage-return bars. ``step(text)``: one stage of a long
command said on its own line (the same rule: a terminal only).
"""

from __future__ import annotations

import sys
from typing import IO, Any


class TerminalProgress:
    def __init__(self, desc: str, *, unit: str = "it", stream: IO[str] | None = None) -> None:
        self.desc = desc
        self._stream = stream if stream is not None else sys.stderr
        self.shown = _is_terminal(self._stream)
        self._bar: Any = None
        if self.shown:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=0, unit=unit, desc=desc, file=self._stream)

    def __call__(self, done: int, total: int) -> None:
        if not self.shown:
            return
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = done
            self._bar.refresh()
        else:
            print(f"\r{self.desc}: {done}/{total}", end="", file=self._stream, flush=True)

    def step(self, text: str) -> None:
        if self.shown:
            print(f"{self.desc}: {text}", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.shown:
            print(file=self._stream)


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False
