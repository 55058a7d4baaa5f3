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
"""

from __future__ import annotations

import concurrent.futures
import logging
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
                                             timeout=cfg.timeout, producer_id=producer_id)
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
