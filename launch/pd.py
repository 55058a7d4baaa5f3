"""A prefill/decode pair on one machine: one Redis, a shared keyring, one daemon per side.

``PDCluster(redis_url=None, *, host_capacity="256MiB", log_level=None, settings=None)`` — a
context manager (``settings``: ``--set`` values both daemons get, e.g. ``peers.enabled``).
``start()``: a ``redis-server`` on a free port in its own temp dir (unless
``redis_url`` names one), a signing keyring (as ``statetier keygen`` writes it), then two
``DaemonProcess`` es, ``prefill`` and ``decode``, each with its own Unix socket, disk dir and
metrics port, both with ``--redis-url`` and the keyring; returns once both serve.
``close()``: SIGTERM to the daemons, then Redis; removes the directory. Used by the PD
example (examples/pd_disaggregation.py) and the PD handoff benchmark.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from statetier.protocol.keyring import Keyring

from .daemons import DaemonProcess
from .redis_servers import RedisServer


class PDCluster:
    def __init__(self, redis_url: str | None = None, *, host_capacity: str = "256MiB",
                 log_level: str | None = None, settings: dict[str, object] | None = None) -> None:
        self.redis_url = redis_url
        self.settings = dict(settings or {})
        self.host_capacity, self.log_level = host_capacity, log_level
        self.directory: Path | None = None
        self.prefill: DaemonProcess | None = None
        self.decode: DaemonProcess | None = None
        self._redis: RedisServer | None = None

    def __enter__(self) -> "PDCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self) -> "PDCluster":
        self.directory = Path(tempfile.mkdtemp(prefix="st-pd-", dir="/tmp"))  # AF_UNIX paths are short
        if self.redis_url is None:
            self._redis = RedisServer().start()
            self.redis_url = self._redis.url
        keyring = self.directory / "keyring.json"
        Keyring.generate().save(keyring)  # what ``statetier keygen --out`` writes (mode 0600)
        self.prefill, self.decode = (
            DaemonProcess(name=side, directory=self.directory / side, host_capacity=self.host_capacity,
                          redis_url=self.redis_url, keyring=keyring, log_level=self.log_level,
                          settings=self.settings)
            for side in ("prefill", "decode"))
        self.prefill.start()
        self.decode.start()
        return self

    def close(self) -> None:
        for daemon in (self.decode, self.prefill):
            if daemon is not None:
                daemon.close()
        if self._redis is not None:
            self._redis.close()
            self._redis = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
