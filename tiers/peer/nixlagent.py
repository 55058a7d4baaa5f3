"""This process's NIXL agent (UCX backend): the only module that imports ``nixl_cu12``.

- ``importable() -> str | None`` — None when ``nixl_cu12`` imports here, else why not.
- ``NixlAgent(name)`` — ``register(address, length)`` host memory as ``DRAM``
  (``[(address, length, 0, "")]``; the arena once at start, an ``into`` outside it per pull)
  and ``deregister(region)``; ``covers(address, length)`` (inside memory registered here);
  ``metadata()`` (what another agent needs to reach this one); ``add_remote(metadata)`` /
  ``forget_remote(name)``; ``read(local, length, remote, name)`` posts a READ of
  ``length`` bytes at ``remote`` in agent ``name``'s registered memory into ``local`` and
  ``state(handle)`` says ``"DONE"``, ``"PROC"`` or ``"ERR"`` (a NIXL error, a remote
  disconnect among them, is ``"ERR"``); ``release(handle)`` — False when NIXL could not
  cancel a transfer still in flight (the handle is then kept, released at ``close()``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("statetier.peer.nixl")


def importable() -> str | None:
    try:
        import nixl_cu12._api  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install (numpy missing, a library not found)
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True, slots=True)
class Region:
    address: int
    length: int
    descs: Any  # NIXL's registration list, for deregister


class NixlAgent:
    def __init__(self, name: str) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._regions: list[Region] = []
        self._stuck: list[Any] = []  # transfers NIXL could not cancel: released at close

    def register(self, address: int, length: int) -> Region:
        descs = self._agent.register_memory([(address, length, 0, "")], "DRAM")
        region = Region(address, length, descs)
        self._regions.append(region)
        return region

    def deregister(self, region: Region) -> None:
        self._regions.remove(region)
        self._agent.deregister_memory(region.descs)

    def covers(self, address: int, length: int) -> bool:
        return any(r.address <= address and address + length <= r.address + r.length for r in self._regions)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def forget_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone: nothing to forget
            log.debug("NIXL: forgetting agent %s: %s", name, exc)

    def read(self, local: int, length: int, remote: int, name: str) -> Any:
        agent = self._agent
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs([(local, length, 0)], "DRAM"),
                                       agent.get_xfer_descs([(remote, length, 0)], "DRAM"), name)
        try:
            agent.transfer(handle)
        except Exception:
            self.release(handle)
            raise
        return handle

    def state(self, handle: Any) -> str:
        try:
            return str(self._agent.check_xfer_state(handle))
        except Exception as exc:  # nixlRemoteDisconnectError and the like
            log.debug("NIXL: transfer state: %s", exc)
            return "ERR"

    def release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            log.warning("NIXL: a transfer could not be cancelled (%s); its handle is kept until close", exc)
            self._stuck.append(handle)
            return False
        return True

    def close(self) -> None:
        for handle in self._stuck:
            self.release_quietly(handle)
        self._stuck.clear()
        for region in list(self._regions):
            try:
                self.deregister(region)
            except Exception as exc:
                log.debug("NIXL: deregistering at close: %s", exc)

    def release_quietly(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            log.debug("NIXL: releasing at close: %s", exc)
