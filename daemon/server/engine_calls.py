"""What the server calls on the engine: ``EngineCalls``, a typed ``Protocol``.

The server never imports ``daemon.engine`` (``daemon.app`` wires the two); it sees the engine
through this, and ``daemon.engine.Engine`` satisfies it structurally (a test compares the
signatures). Per opcode (``daemon.server.dispatch``):

- PUT / PUT_BATCH → ``put_batch``; LOAD / LOAD_BATCH → ``load_batch``, then ``release`` /
  ``release_many`` of what could not be sent; RELEASE → ``release_many``; a connection gone
  → ``release_owner``
- LOOKUP → ``lookup``; DELETE → ``delete``; STATS → ``stats``; INSPECT → ``inspect``;
  VERIFY → ``verify_all``; LIST → ``list_objects``; PURGE → ``purge``
- ``executor``: where the load window's copies run (``protocol.thresholds.run_work``)
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Callable, Protocol

from statetier.daemon.requests import Incoming, JointHit, LoadRequest, LoadResult, LookupRequest, PutResult
from statetier.protocol.errors import StatetierError
from statetier.protocol.identity import Namespace, StateRef


class EngineCalls(Protocol):
    executor: Executor | None

    async def put_batch(self, items: list[Incoming]) -> list[PutResult | StatetierError | None]: ...

    async def load_batch(self, reqs: list[LoadRequest], owner: object) -> list[LoadResult | StatetierError | None]:
        ...

    async def release(self, lease_id: int, owner: object) -> bool: ...

    async def release_many(self, lease_ids: list[int], owner: object) -> int: ...

    async def release_owner(self, owner: object) -> int: ...

    async def lookup(self, req: LookupRequest, owner: object) -> JointHit: ...

    async def delete(self, tenant: str, ref: StateRef) -> int: ...

    def stats(self) -> dict: ...

    async def inspect(self, tenant: str, state_id: bytes) -> dict: ...

    async def verify_all(self, tenant: str | None = None,
                         progress: Callable[[int, int], object] | None = None) -> dict: ...

    async def list_objects(self, tenant: str, *, everyone: bool = False) -> dict: ...

    async def purge(self, tenant: str, *, namespace: Namespace | None = None, of_tenant: str | None = None,
                    is_operator: bool = False) -> dict: ...
