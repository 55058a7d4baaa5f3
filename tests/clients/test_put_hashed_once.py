"""Issue 42, item 2: a put through the shared-memory window is hashed once, by the client.

Against a real daemon process (``launch.DaemonProcess``) and a client that maps its windows:

- the client copies each payload byte into the put window once and hashes it once, as it
  copies (``copies.fill_and_digest``), and sends the regions' digests with the put; the
  daemon copies the window into its arena once and hashes nothing (its
  ``statetier_payload_pass_bytes_total``): it seals over the client's digests;
- a client that lies about its digests (here: the digests of other bytes) makes an object
  that every load refuses as a corrupt payload, the daemon drops the copy on the recheck
  and goes on serving: docs/protocol.md §6.1, the trust statement.
"""

from __future__ import annotations

import pytest
import torch

import statetier.clients.transfers as transfers
from statetier.clients import AsyncClient
from statetier.clients.copies import fill_and_digest
from statetier.launch import DaemonProcess
from statetier.protocol.errors import CorruptPayload, NotFound
from statetier.protocol.identity import NamespaceSpec
from statetier.protocol.passes import PASSES

SHAPE = (256, 1024)  # 512 KiB of bfloat16: two 64-aligned tensors, no padding
PAYLOAD = 2 * 256 * 1024 * 2


def page(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(SHAPE, generator=gen).to(torch.bfloat16) for name in ("k", "v")}


@pytest.fixture(scope="module")
def daemon():
    # no disk tier: a write-behind copy is read verified (hashed) from the arena, which
    # would race the count of the put's own passes
    with DaemonProcess(name="put-once", host_capacity="64MiB", settings={"disk.enabled": "false"}) as proc:
        yield proc


def daemon_passes(daemon: DaemonProcess) -> tuple[float, float]:
    samples = daemon.scrape()
    return tuple(samples.value("statetier_payload_pass_bytes_total", op=op) for op in ("copied", "hashed"))


async def test_a_windowed_put_is_copied_once_per_hop_and_hashed_once_by_the_client(daemon) -> None:
    async with AsyncClient(daemon.url, namespace=NamespaceSpec("put-once"), use_shm=True) as client:
        assert client.uses_shm
        tensors = page(1)
        await client.put_kv(0, bytes(32), 0, 16, page(0), request_id="warm")  # the window mapped, pools warm
        daemon_before, before = daemon_passes(daemon), PASSES.snapshot()
        ref = await client.put_kv(1, bytes(32), 0, 16, tensors, request_id="once")
        after, daemon_after = PASSES.snapshot(), daemon_passes(daemon)
        assert (after.copied - before.copied, after.hashed - before.hashed) == (PAYLOAD, PAYLOAD)  # the client
        assert (daemon_after[0] - daemon_before[0], daemon_after[1] - daemon_before[1]) == (PAYLOAD, 0)  # the daemon
        loaded = await client.load(ref)
        assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)


async def test_a_lying_digest_makes_an_object_every_load_refuses_and_the_daemon_serves_on(daemon, monkeypatch) -> None:
    def lying(region, layout, tensors, alg):
        digests = fill_and_digest(region, layout, tensors, alg)
        return tuple(bytes(reversed(d)) for d in digests)  # digests of other bytes

    async with AsyncClient(daemon.url, namespace=NamespaceSpec("put-lies"), use_shm=True) as client:
        monkeypatch.setattr(transfers, "fill_and_digest", lying)
        lie = await client.put_kv(0, bytes(32), 0, 16, page(2), request_id="lie")  # sealed as told
        monkeypatch.undo()
        with pytest.raises(CorruptPayload):  # the client's check, then the daemon's recheck: damage
            await client.load(lie)
        with pytest.raises((CorruptPayload, NotFound)):  # dropped on the recheck: never served
            await client.load(lie)
        tensors = page(3)
        honest = await client.put_kv(1, bytes(32), 0, 16, tensors, request_id="honest")
        loaded = await client.load(honest)
        assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)
        assert await client.ping() >= 0
