"""A statetier daemon with its peer tier on, for the end-to-end peer tests.

``peer_daemon(name, redis_url, keyring, peers, **settings)`` — a context manager: a
``DaemonProcess`` started with ``peers`` (the calling module's ``[peers]`` settings, read when
called: the NIXL re-run changes them in place) and ``settings`` over them; its log tail printed
and the process closed on the way out.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from statetier.launch import DaemonProcess


@contextlib.contextmanager
def peer_daemon(name: str, redis_url: str, keyring, peers: dict, **settings) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(name=name, redis_url=redis_url, keyring=keyring, settings={**peers, **settings})
    try:
        yield proc.start()
    finally:
        print(f"--- log tail of {name}:\n{proc.log_tail()}")
        proc.close()
