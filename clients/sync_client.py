"""The blocking client: ``AsyncClient`` on a private event loop in a background thread.

``Client(url, **options)`` takes ``AsyncClient``'s options; ``connect()`` starts the thread
and its loop (uvloop when installed, else asyncio) and connects; ``close()`` closes the
connection, stops the loop and joins the thread. Use ``with Client(...) as client:``.
Every ``AsyncClient`` call has a blocking twin of the same name and signature (``put_kv``,
``load``, ``lookup``, ``put_many`` …) that runs the coroutine on the private loop with
``run_coroutine_threadsafe`` and waits; an interrupt while waiting cancels the call.
No global event loop is touched; calling from the client's own loop thread is refused.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Callable, Coroutine

from statetier.protocol.errors import ClientClosedError

from .async_client import AsyncClient


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _blocking(name: str) -> Callable:
    method = getattr(AsyncClient, name)

    @functools.wraps(method)
    def call(self: "Client", *args: Any, **kwargs: Any) -> Any:
        return self._run(lambda: getattr(self._client, name)(*args, **kwargs))

    return call


class Client:
    """A blocking statetier client; see ``AsyncClient`` for the calls and their options."""

    def __init__(self, url: str, *, use_uvloop: bool = True, **options: Any) -> None:
        self._client = AsyncClient(url, **options)
        self._use_uvloop = use_uvloop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._is_closed = False

    # -- lifecycle ----------------------------------------------------------------------

    def connect(self) -> "Client":
        if self._is_closed:
            raise ClientClosedError("the statetier client is closed")
        if self._thread is None:
            self._loop = _new_loop() if self._use_uvloop else asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._serve_loop, name="statetier-client", daemon=True)
            self._thread.start()
        try:
            self._run(self._client.connect)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._is_closed:
            return
        if self._thread is not None and self._loop is not None:  # made together in connect()
            try:
                self._run(self._client.close)
            finally:
                self._is_closed = True
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
        self._is_closed = True

    def __enter__(self) -> "Client":
        return self.connect()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _serve_loop(self) -> None:
        loop = self._loop
        assert loop is not None  # made before this thread starts
        asyncio.set_event_loop(loop)  # this thread only
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _run(self, make: Callable[[], Coroutine]) -> Any:
        if self._is_closed or self._loop is None:
            raise ClientClosedError("the statetier client is closed" if self._is_closed else
                                    "the statetier client is not connected: call connect() first")
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking statetier call from the client's own event loop would deadlock")
        future = asyncio.run_coroutine_threadsafe(make(), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt while waiting: the call stops too
            raise

    # -- calls ------------------------------------------------------------------------

    @property
    def namespace(self):
        return self._client.namespace

    @property
    def spec(self):
        """The ``NamespaceSpec`` the client was built with (``None`` for a bare ``Namespace``)."""
        return self._client.spec

    @property
    def uses_shm(self) -> bool:
        return self._client.uses_shm

    @property
    def server_info(self) -> dict:
        return self._client.server_info

    @property
    def owned_namespace(self):
        return self._client.owned_namespace

    def events_topic(self, template: str = "{namespace}") -> str:
        return self._client.events_topic(template)

    def kv_key(self, *args: Any, **kwargs: Any):
        return self._client.kv_key(*args, **kwargs)

    def ssm_key(self, *args: Any, **kwargs: Any):
        return self._client.ssm_key(*args, **kwargs)

    def group_key(self, *args: Any, **kwargs: Any):
        return self._client.group_key(*args, **kwargs)

    put = _blocking("put")
    put_kv = _blocking("put_kv")
    put_ssm = _blocking("put_ssm")
    put_group = _blocking("put_group")
    put_many = _blocking("put_many")
    load = _blocking("load")
    load_group = _blocking("load_group")
    load_with_ref = _blocking("load_with_ref")
    load_many = _blocking("load_many")
    lookup = _blocking("lookup")
    release = _blocking("release")
    delete = _blocking("delete")
    stats = _blocking("stats")
    inspect = _blocking("inspect")
    verify = _blocking("verify")
    list_objects = _blocking("list_objects")
    purge = _blocking("purge")
    ping = _blocking("ping")
