"""What every part of the asyncio client shares: one connection in one tenant and namespace.

- ``ClientSession(url, *, namespace, tenant, token, ssl, use_shm, producer_id, timeout,
  concurrency)`` — the base of ``AsyncClient``'s parts (``transfer_calls``, ``lookup_calls``,
  ``admin_calls``): ``connect()`` / ``close()`` / ``async with``, the HELLO_OK it got
  (``server_info``, ``uses_shm``, ``owned_namespace``, ``events_topic``), the keys in its
  namespace (``kv_key``, ``ssm_key``, ``group_key``), and what a part reaches the daemon
  through: ``_connection()`` (``ClientClosedError`` once closed), ``_transfers_now()``,
  ``_request(op, meta)``, ``_own_namespace()``.
- ``DEFAULT_CONCURRENCY``, ``checked_concurrency(n)`` — a ``load_many``'s frames in flight.
"""

from __future__ import annotations

import logging
import ssl as _ssl
from concurrent.futures import ThreadPoolExecutor
from typing import Self, Sequence

from statetier.protocol.errors import ClientClosedError, InvalidRequest, MalformedFrame
from statetier.protocol.frames import Op
from statetier.protocol.identity import Kind, Namespace, NamespaceSpec, StateKey
from statetier.protocol.kv_events import event_topic
from statetier.protocol.ownership import owned_namespace

from . import transport
from .batches import LOAD_IN_FLIGHT
from .shm import ClientWindows
from .transfers import Transfers
from .values import LayerGroup

#: ``load_many``'s frames in flight unless a client or call says otherwise (measured: two
#: overlap the daemon's reads with this process's copies; see ``batches``)
DEFAULT_CONCURRENCY = LOAD_IN_FLIGHT
log = logging.getLogger("statetier.client")


class ClientSession:
    """A connection to the daemon, in one tenant and (for puts and loads) one namespace."""

    def __init__(
        self,
        url: str,
        *,
        namespace: Namespace | NamespaceSpec | None = None,
        tenant: str = "default",
        token: str | None = None,
        ssl: _ssl.SSLContext | None = None,
        use_shm: bool = True,
        producer_id: str = "",
        timeout: float = 10.0,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        self.url = url
        self.spec = namespace if isinstance(namespace, NamespaceSpec) else None
        self.namespace = namespace.namespace() if isinstance(namespace, NamespaceSpec) else namespace
        if self.namespace is not None and not isinstance(self.namespace, Namespace):
            raise InvalidRequest("namespace must be a Namespace, a NamespaceSpec or None")
        self.tenant = tenant
        self.producer_id = producer_id
        self.concurrency = checked_concurrency(concurrency)
        self._token, self._ssl, self._use_shm, self._timeout = token, ssl, use_shm, timeout
        self._conn: transport.Connection | None = None
        self._transfers: Transfers | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._is_closed = False

    # -- lifecycle ----------------------------------------------------------------------

    async def connect(self) -> Self:
        if self._is_closed:
            raise ClientClosedError("the statetier client is closed")
        if self._conn is not None:
            return self
        conn = await transport.connect(self.url, tenant=self.tenant, token=self._token, ssl=self._ssl,
                                       shm=self._use_shm, timeout=self._timeout)
        windows = None
        if conn.shm is not None:
            try:
                windows = ClientWindows.open(conn.shm)
            except OSError as exc:  # this process cannot map them: the inline path still works
                log.warning("statetier: shared-memory windows unusable, using inline transfers: %s", exc)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="statetier-copy")
        self._conn, self._transfers = conn, Transfers(conn, windows, self._executor)
        return self

    async def close(self) -> None:
        """Close the connection (the daemon drops this client's leases) and unmap the arena."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            if self._conn is not None:
                await self._conn.close()
        finally:
            if self._transfers is not None and self._transfers.windows is not None:
                self._transfers.windows.close()  # deferred while a copy still holds a region
            if self._executor is not None:
                self._executor.shutdown(wait=False)

    async def __aenter__(self) -> Self:
        return await self.connect()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    @property
    def uses_shm(self) -> bool:
        """Whether puts and loads go through the connection's shared-memory windows."""
        return self._transfers is not None and self._transfers.windows is not None

    @property
    def server_info(self) -> dict:
        """HELLO_OK as the daemon sent it (version, max_frame, max_inflight, shm, tenant …)."""
        return dict(self._connection().hello)

    @property
    def owned_namespace(self) -> Namespace:
        """The namespace the daemon keeps this client's objects under: ``namespace`` taken into
        the tenant HELLO_OK named (``protocol.ownership``). Refs, ``statetier ls`` and the KV
        events carry it; a connected client with a namespace only."""
        return owned_namespace(self._admitted_tenant(), self._own_namespace())

    def events_topic(self, template: str = "{namespace}") -> str:
        """The topic of this client's namespace in its tenant's KV event stream, ``template``
        being the daemon's ``events.topic``: what a SUB socket subscribes to for its events."""
        return event_topic(template, self._admitted_tenant(), self.owned_namespace.digest)

    def _admitted_tenant(self) -> str:
        tenant = self._connection().hello.get("tenant")
        if not isinstance(tenant, str):
            raise MalformedFrame("HELLO_OK names no tenant")
        return tenant

    # -- keys ---------------------------------------------------------------------------

    def kv_key(self, layer: int, prefix_hash: bytes, token_start: int, token_end: int, *,
               shard: int = 0, group_layers: Sequence[int] = ()) -> StateKey:
        """The key of the KV page of ``layer`` covering ``[token_start, token_end)``."""
        return StateKey(self._own_namespace(), Kind.KV, layer, prefix_hash, token_start, token_end,
                        shard, tuple(group_layers))

    def ssm_key(self, layer: int, prefix_hash: bytes, tokens_absorbed: int, *, shard: int = 0) -> StateKey:
        """The key of ``layer``'s snapshot after ``tokens_absorbed`` tokens of ``prefix_hash``."""
        return StateKey(self._own_namespace(), Kind.SSM, layer, prefix_hash, 0, tokens_absorbed, shard)

    def group_key(self, group: LayerGroup, prefix_hash: bytes, token_start: int, token_end: int, *,
                  shard: int = 0) -> StateKey:
        """The key of ``group``'s object: a KV group's block ``[token_start, token_end)`` of every
        layer, an SSM group's snapshots of every layer after ``token_end`` tokens (``token_start`` 0)."""
        return group.key(self._own_namespace(), prefix_hash, token_start, token_end, shard)

    # -- internals ----------------------------------------------------------------------

    def _connection(self) -> transport.Connection:
        if self._is_closed:
            raise ClientClosedError("the statetier client is closed")
        if self._conn is None:
            raise ClientClosedError("the statetier client is not connected: await connect() first")
        return self._conn

    def _transfers_now(self) -> Transfers:
        self._connection()
        assert self._transfers is not None  # made with the connection
        return self._transfers

    async def _request(self, op: Op, meta):
        return await self._connection().request(op, meta)

    def _own_namespace(self) -> Namespace:
        if self.namespace is None:
            raise InvalidRequest("this client has no namespace: pass namespace= to put, load or lookup")
        return self.namespace


def checked_concurrency(concurrency: int) -> int:
    """A count of frames in flight: an int of at least 1, else ``InvalidRequest``."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidRequest(f"concurrency must be an int of at least 1, not {concurrency!r}")
    return concurrency

