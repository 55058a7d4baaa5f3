"""The blocking client: ``AsyncClient`` on a private event loop in a background thread.

``Client(url, **options)`` takes ``AsyncClient``'s options; ``connect()`` starts the thread
and its loop (uvloop when installed, else asyncio) and connects; ``close()`` closes the
connection, stops the loop and joins the thread. Use ``with Client(...) as client:``.
Every ``AsyncClient`` call has a blocking twin of the same name and signature (``put_kv``,
``load``, ``lookup``, ``put_many`` …) that runs the coroutine on the private loop with
``run_coroutine_threadsafe`` and waits; an interrupt while waiting cancels the call.
No global event loop is touched; calling from the client's own loop thread is refused.

For callers that must never wait on the daemon (vLLM's scheduler step): ``submit(name, ...)``
starts a call and returns a ``concurrent.futures.Future`` of its result (connecting first
when needed, without waiting either); ``close_nowait()`` closes the connection (its pending
calls fail with ``ClientClosedError``), lets them finish, and stops the loop, returning at once.

``thread_cpus``: the CPUs the client's loop thread runs on (Linux; threads it starts, such as
the copy thread, inherit them). Without it the thread inherits its creator's affinity: inside
vLLM's CPU worker that is the main thread's pin to one OpenMP core (see
``clients/vllm/link.py``'s ``connector_cpus``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from typing import Any, Callable, Collection, Coroutine

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

    def __init__(self, url: str, *, use_uvloop: bool = True, thread_cpus: Collection[int] | None = None,
                 **options: Any) -> None:
        self._client = AsyncClient(url, **options)
        self._use_uvloop = use_uvloop
        self._thread_cpus = frozenset(thread_cpus) if thread_cpus else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._is_closed = False
        self._connecting: asyncio.Future | None = None  # submit's connect, on the loop

    # -- lifecycle ----------------------------------------------------------------------

    def connect(self) -> "Client":
        if self._is_closed:
            raise ClientClosedError("the statetier client is closed")
        self._start_loop()
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

    def close_nowait(self) -> concurrent.futures.Future:
        """Close without waiting: the connection goes (pending calls fail with
        ``ClientClosedError``), the calls still running finish, then the loop stops. The
        future returned is done once the connection takes no new frame: a call whose
        bytes were being copied out when this was called sends nothing after that."""
        refusing: concurrent.futures.Future = concurrent.futures.Future()
        if self._is_closed or self._thread is None:
            self._is_closed = True
            refusing.set_result(None)
            return refusing
        self._is_closed = True
        loop, client = self._loop, self._client
        assert loop is not None  # made with the thread, in _start_loop

        async def wind_down() -> None:
            try:
                if self._connecting is not None and not self._connecting.done():
                    self._connecting.cancel()  # a handshake the daemon does not answer ends now
                closing = asyncio.ensure_future(client.close())
                await asyncio.sleep(0)  # its first step marks the connection closed, before any await
                refusing.set_result(None)
                await closing
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                if others:
                    await asyncio.wait(others)
            finally:
                if not refusing.done():
                    refusing.set_result(None)
                loop.stop()

        asyncio.run_coroutine_threadsafe(wind_down(), loop)
        return refusing

    def __enter__(self) -> "Client":
        return self.connect()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _start_loop(self) -> None:
        if self._thread is None:
            self._loop = _new_loop() if self._use_uvloop else asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._serve_loop, name="statetier-client", daemon=True)
            self._thread.start()

    def _serve_loop(self) -> None:
        loop = self._loop
        assert loop is not None  # made before this thread starts
        if self._thread_cpus:
            os.sched_setaffinity(0, self._thread_cpus)  # this thread, and those it starts
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

    def submit(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Start the call ``name`` (``"lookup"``, ``"put_many"``, ``"load_many"`` …) and return
        a ``concurrent.futures.Future`` of its result, connecting first when not connected
        yet; never waits on the daemon. Cancelling the future cancels the call."""
        if self._is_closed:
            raise ClientClosedError("the statetier client is closed")
        method = getattr(AsyncClient, name, None)
        if method is None or not asyncio.iscoroutinefunction(method) or name.startswith("_"):
            raise AttributeError(f"the statetier client has no call {name!r}")
        self._start_loop()
        client = self._client

        async def call() -> Any:
            try:
                await self._connected_on_loop()
            except asyncio.CancelledError:
                if self._is_closed:  # close_nowait cancelled the connect
                    raise ClientClosedError("the statetier client is closed") from None
                raise
            if self._is_closed:  # closed while connecting: nothing may be sent after close_nowait
                raise ClientClosedError("the statetier client is closed")
            return await getattr(client, name)(*args, **kwargs)

        assert self._loop is not None  # _start_loop made it above
        return asyncio.run_coroutine_threadsafe(call(), self._loop)

    async def _connected_on_loop(self) -> None:
        """Connect once for every submitted call (a failed attempt is tried again by the next)."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._client.connect())
        connecting = self._connecting
        try:
            await asyncio.shield(connecting)
        except BaseException:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None
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
