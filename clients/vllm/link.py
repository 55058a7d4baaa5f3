"""The connector's connection to the daemon: calls started, never waited on past a deadline.

``DaemonLink(cfg, spec, *, use_shm, producer_id)``; used by both connector sides:

- ``submit(name, *args, **kwargs)`` → a ``concurrent.futures.Future`` of the client call
  ``name`` (``"lookup"``, ``"put_many"``, ``"load_many"`` …), connecting first when needed,
  never waiting on the daemon. Raises ``Unavailable`` at once while the link is *suspect*.
- ``overdue(future)`` — a call outlived the deadline: the link is suspect until that call
  answers (a late answer clears it). ``abandon()`` — drop the connection now (its pending
  calls fail with ``ClientClosedError``, nothing more is sent on it: see
  ``Client.close_nowait``); the link is suspect until a ping on a new connection answers.
- ``failed(exc)`` — a call failed: a lost or closed connection is abandoned.
- ``release(lease_ids)`` — leases back, not waited on; ``connected()`` — the client once
  connected (waits: only at start, for the KV events topic).

While suspect, the caller treats the daemon as absent (a miss, a skipped save): a stopped
daemon costs each engine step at most one deadline, and afterwards nothing. ``close()``.

The client's threads (its event loop, its copy thread) run on ``connector_cpus()``: the
CPUs this machine lets the process use that vLLM's CPU worker did not bind OpenMP threads to
(vLLM reserves one per worker for a connector when it has cores to spare), else all of them.
Without this they inherit the thread that starts them: in vLLM's CPU worker, the main
thread, which libgomp pins to the first OpenMP core, so every save ran on the core of the
forward pass.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
from typing import TYPE_CHECKING, Any

from statetier.protocol.errors import ClientClosedError, Unavailable
from statetier.protocol.identity import NamespaceSpec

from .layout import ConnectorConfig

if TYPE_CHECKING:
    from ..sync_client import Client

log = logging.getLogger("statetier.vllm")


class DaemonLink:
    def __init__(self, cfg: ConnectorConfig, spec: NamespaceSpec, *, use_shm: bool = True,
                 producer_id: str = "") -> None:
        self.cfg, self.spec = cfg, spec
        self._options: dict[str, Any] = dict(namespace=spec, tenant=cfg.tenant, token=cfg.token, use_shm=use_shm,
                                             timeout=cfg.timeout, producer_id=producer_id,
                                             thread_cpus=connector_cpus())
        self._client: Client | None = None
        self._probe: concurrent.futures.Future | None = None  # set: suspect until it answers

    @property
    def is_answering(self) -> bool:
        """False while suspect; a failed probe is replaced by a ping on a new connection."""
        probe = self._probe
        if probe is None:
            return True
        if not probe.done():
            return False
        if probe.cancelled() or probe.exception() is not None:
            self._replace_client()
            self._probe = self._client_now().submit("ping")
            return False
        self._probe = None
        return True

    def submit(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        if not self.is_answering:
            raise Unavailable("the statetier daemon missed a deadline and has not answered since")
        return self._client_now().submit(name, *args, **kwargs)

    def overdue(self, future: concurrent.futures.Future) -> None:
        if self._probe is None:
            self._probe = future

    def abandon(self) -> concurrent.futures.Future:
        """Drop the connection; the returned future is done once it sends nothing more."""
        refusing = self._replace_client()
        self._probe = self._client_now().submit("ping")
        return refusing

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, (Unavailable, ClientClosedError)) and self._probe is None:
            self.abandon()

    def release(self, lease_ids) -> None:
        """Give leases back without waiting (on the connection that holds them: a dropped
        connection's leases went with it)."""
        if self._client is not None and lease_ids:
            try:
                self._client.submit("release", list(lease_ids))
            except ClientClosedError:
                pass

    def connected(self):
        """The client, connected: waits (at start, for the KV events topic) up to ``cfg.timeout``."""
        self._client_now().submit("ping").result(timeout=self.cfg.timeout)
        return self._client

    def _client_now(self):
        if self._client is None:
            from ..sync_client import Client

            self._client = Client(self.cfg.url, **self._options)
        return self._client

    def _replace_client(self) -> concurrent.futures.Future:
        client, self._client = self._client, None
        if client is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        log.warning("statetier: dropping the connection to the daemon; calls resume when it answers again")
        return client.close_nowait()

    def close(self) -> None:
        if self._client is not None:
            self._client.close_nowait()
            self._client = None


def connector_cpus(environ=os.environ) -> frozenset[int]:
    """The CPUs for the connector's threads: those allowed to this process (its cgroup's
    cpuset, else every online CPU) less those OpenMP threads are bound to (``OMP_PLACES``,
    ``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``'s proclist, as vLLM's CPU worker sets them), or
    all of the allowed ones when OpenMP holds them all."""
    allowed = _allowed_cpus()
    free = allowed - _openmp_cpus(environ)
    return frozenset(free or allowed)


def _allowed_cpus() -> frozenset[int]:
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path) as f:
                cpus = _cpu_ids(f.read())
        except OSError:
            continue
        if cpus:
            return cpus
    return frozenset(range(os.cpu_count() or 1))


def _openmp_cpus(environ) -> frozenset[int]:
    kmp = re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))
    return (_cpu_ids(environ.get("OMP_PLACES", "")) | _cpu_ids(environ.get("GOMP_CPU_AFFINITY", ""))
            | _cpu_ids(kmp.group(1) if kmp else ""))


def _cpu_ids(text: str) -> frozenset[int]:
    """CPU ids in a list such as ``0-3,8`` / ``{0,1}`` / ``0 1 2`` (named places give none)."""
    ids: set[int] = set()
    for first, last in re.findall(r"(\d+)(?:-(\d+))?", text):
        ids.update(range(int(first), int(last or first) + 1))
    return frozenset(ids)
