"""End to end, daemon in a subprocess: what a worker on the same host can see and change.

- Tenant isolation: a worker of tenant A stores and loads a page through shared memory;
  a worker of tenant B (another process, its own token) does the same with its own page,
  then reads every shared mapping it holds: A's bytes are in none of them.
- Verification where the bytes land: a worker scribbles, from a thread, on every byte of
  a page it can find in any *writable* shared mapping of its own process while it loads
  that page again and again; each load is the exact page or ``CorruptPayload``, never a
  silently wrong tensor. A read-only mapping that holds the page cannot be written, not
  even through ``/proc/self/mem``.
- A worker that cannot map the windows (``use_shm=True``, but its address space has no
  room for them) is served inline instead of failing.
- Batch frames: ``put_many`` / ``load_many`` round-trip exactly; a batch with a missing
  target raises its error and every window region goes back.
- A put on a lost connection is ``Unavailable`` (its window region freed once).
- Damage in the daemon's own arena (which no client can reach) is found by the client where
  the bytes land; the SDK's recheck makes the daemon drop that copy and serve disk's.

Under the old design (every worker mapped the whole host arena read/write, and the
daemon verified a load in that arena before the worker copied it out) the first two
fail: B found A's page in its mapping, and a scribbler changed bytes between the
daemon's check and the copy.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from statetier.clients import AsyncClient, PutItem
from statetier.clients.tensors import tensor_bytes
from statetier.daemon.server.auth import token_sha256
from statetier.protocol.errors import CorruptPayload, NotFound, Unavailable
from tests.support.daemons import arena_copy, daemon_fixture
from tests.support.jamba import jamba_namespace
from tests.support.waiting import eventually

TOKENS = {"a": "tenant-a-isolation-token", "b": "tenant-b-isolation-token"}
PAGE_SHAPE = (2, 8, 512, 128)  # 2 MiB of bfloat16
PROBE = slice(1 << 20, (1 << 20) + 64)  # 64 bytes from the middle of the page's payload


@pytest.fixture(scope="module")
def daemon(request):
    tenants = [{"name": name, "token_sha256": token_sha256(token)} for name, token in TOKENS.items()]
    return daemon_fixture(request, config={"tenants": tenants + [{"name": "default"}]})


def random_page(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(*PAGE_SHAPE, generator=gen).to(torch.bfloat16)}


def page_bytes(page: dict[str, torch.Tensor]) -> bytes:
    return tensor_bytes(page["kv"]).numpy().tobytes()


def shared_mappings(pid: str = "self") -> list[tuple[int, int, str]]:
    """(start, end, permissions) of every shared mapping (memfd, /dev/shm, any file)."""
    found = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            perms = fields[1]
            if perms[3] == "s" and perms[0] == "r":
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, perms))
    return found


def occurrences(probe: bytes, writable: bool | None = None) -> list[tuple[int, str]]:
    """Addresses of ``probe`` in this process's shared mappings (and their permissions)."""
    hits = []
    for start, end, perms in shared_mappings():
        if writable is not None and (perms[1] == "w") != writable:
            continue
        data = ctypes.string_at(start, end - start)
        at = data.find(probe)
        while at >= 0:
            hits.append((start + at, perms))
            at = data.find(probe, at + 1)
    return hits


WORKER_B = r'''
import asyncio, ctypes, json, sys
import torch
from statetier.clients import AsyncClient
from statetier.protocol.identity import NamespaceSpec

async def main(url, token, probe_hex):
    spec = NamespaceSpec(model_id="isolation-b", kv_block_size=16)
    async with AsyncClient(url, namespace=spec, tenant="b", token=token) as client:
        page = {"kv": torch.full((2, 8, 512, 128), 3.0, dtype=torch.bfloat16)}
        ref = await client.put_kv(0, bytes(32), 0, 512, page, request_id="b")
        loaded = await client.load(ref)
        assert torch.equal(loaded["kv"], page["kv"])
        probe = bytes.fromhex(probe_hex)
        mapped, found = 0, []
        arena = client.server_info.get("shm") or {}
        for line in open("/proc/self/maps"):
            fields = line.split()
            if fields[1][3] != "s" or fields[1][0] != "r":
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            mapped += end - start
            if ctypes.string_at(start, end - start).find(probe) >= 0:
                found.append(line.strip())
        print(json.dumps({"uses_shm": client.uses_shm, "mapped": mapped, "found": found,
                          "path": arena.get("path")}), flush=True)

asyncio.run(main(*sys.argv[1:]))
'''


async def test_a_worker_of_tenant_b_finds_none_of_tenant_a_bytes_in_its_mappings(daemon, tmp_path: Path) -> None:
    page = random_page(11)
    raw = page_bytes(page)
    async with AsyncClient(daemon.url, namespace=jamba_namespace("isolation-a"), tenant="a",
                           token=TOKENS["a"]) as a:
        assert a.uses_shm
        ref = await a.put_kv(0, bytes(32), 0, 512, page, request_id="a")
        assert page_bytes(await a.load(ref)) == raw  # A's page now sits in the daemon's memory

        script = tmp_path / "worker_b.py"
        script.write_text(WORKER_B)
        done = await asyncio.to_thread(subprocess.run, [sys.executable, str(script), daemon.url, TOKENS["b"],
                                                        raw[PROBE].hex()], capture_output=True, text=True,
                                       timeout=120)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["uses_shm"] and seen["mapped"] > 0  # B did use shared memory...
        assert seen["found"] == []  # ...and none of it holds A's page
        assert seen["path"] is None  # nothing to open by name either
        assert page_bytes(await a.load(ref)) == raw


async def test_scribbling_on_every_writable_mapping_never_yields_a_wrong_tensor(daemon) -> None:
    async with AsyncClient(daemon.url, namespace=jamba_namespace("scribbler")) as client:
        assert client.uses_shm
        wrong = corrupt = exact = 0
        for round_ in range(24):
            page = random_page(100 + round_)
            raw = page_bytes(page)
            ref = await client.put_kv(round_, bytes(32), 0, 512, page, request_id="scribbler")
            await client.load(ref)  # once, so that the page has passed through every path
            targets = [address for address, _ in occurrences(raw[PROBE], writable=True)]
            stop = threading.Event()

            def scribble() -> None:  # flips one byte of every copy it can write, again and again
                cells = [ctypes.c_ubyte.from_address(address) for address in targets]
                while not stop.is_set():
                    for cell in cells:
                        cell.value ^= 0x5A

            thread = threading.Thread(target=scribble, daemon=True)
            thread.start()
            try:
                for _ in range(4):
                    try:
                        got = await client.load(ref)
                    except CorruptPayload:
                        corrupt += 1
                        continue
                    if page_bytes(got) == raw:
                        exact += 1
                    else:
                        wrong += 1
            finally:
                stop.set()
                thread.join()
            for address in targets:  # restore what the scribbler may have left flipped
                ctypes.c_ubyte.from_address(address).value = raw[PROBE.start]
        assert wrong == 0, f"{wrong} silently wrong tensors ({exact} exact, {corrupt} refused)"
        assert exact > 0


async def test_a_read_only_mapping_holding_a_loaded_page_cannot_be_written(daemon) -> None:
    async with AsyncClient(daemon.url, namespace=jamba_namespace("read-only")) as client:
        page = random_page(7)
        raw = page_bytes(page)
        ref = await client.put_kv(0, bytes(32), 0, 512, page, request_id="ro")
        assert page_bytes(await client.load(ref)) == raw
        read_only = [address for address, perms in occurrences(raw[PROBE]) if perms[1] != "w"]
        assert read_only  # the load window holds it, read-only
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            for address in read_only:
                mem.seek(address)
                with pytest.raises(OSError):
                    mem.write(b"\x00")


NO_ROOM_FOR_WINDOWS = r'''
import asyncio, resource, sys, torch
from statetier.clients import AsyncClient
from statetier.protocol.identity import NamespaceSpec

def vm_size() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

async def main(url):
    async with AsyncClient(url, namespace=NamespaceSpec(model_id="no-shm")) as client:  # use_shm=True
        page = {"kv": torch.arange(4096, dtype=torch.float32)}
        ref = await client.put_kv(0, bytes(32), 0, 16, page, request_id="x")
        assert torch.equal((await client.load(ref))["kv"], page["kv"])
        print(client.uses_shm)

# an address space with no room left for the 64 MiB windows: mapping them fails for real
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (40 << 20), resource.RLIM_INFINITY))
asyncio.run(main(sys.argv[1]))
'''


async def test_a_worker_that_cannot_map_the_windows_is_served_inline(daemon) -> None:
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", NO_ROOM_FOR_WINDOWS, daemon.url],
                                   capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


async def test_a_batch_with_a_missing_target_raises_its_error_and_gives_every_region_back(daemon) -> None:
    async with AsyncClient(daemon.url, namespace=jamba_namespace("batch")) as client:
        pages = [random_page(200 + i) for i in range(6)]
        refs = await client.put_many([PutItem(client.kv_key(i, bytes(32), 0, 512), page, request_id="batch")
                                      for i, page in enumerate(pages)])
        loaded = await client.load_many(refs)
        assert [page_bytes(p) for p in loaded] == [page_bytes(p) for p in pages]
        gone = dataclasses.replace(refs[3], state_id=bytes(16))
        with pytest.raises(NotFound):
            await client.load_many([refs[0], gone, refs[5]])

        async def regions_back() -> bool:
            return (await client.stats())["daemon"]["window_regions"] == 0

        await eventually(regions_back)


async def test_a_put_on_a_lost_connection_is_unavailable_and_frees_its_window_region_once(request) -> None:
    lone = daemon_fixture(request, name="lone")
    async with AsyncClient(lone.url, namespace=jamba_namespace("lost")) as client:
        page = random_page(1)
        await client.put_kv(0, bytes(32), 0, 512, page, request_id="lost")
        lone.stop()
        for _ in range(2):  # the region is freed once, whichever cleanup path runs
            with pytest.raises(Unavailable):
                await client.put_kv(0, bytes(32), 0, 512, page, request_id="lost")


def flip_in_daemon_arena(pid: int, state_id: bytes, from_end: int) -> None:
    """Flip one payload bit of ``state_id``'s copy in the daemon's own arena (what only a
    daemon bug or root could do: no client maps it), found through ``/proc/<pid>/fd``."""
    with arena_copy(pid, state_id) as (arena, at, length):
        arena[at + length - from_end] ^= 0x10


async def test_damage_in_the_daemons_arena_is_found_where_the_bytes_land_and_the_disk_copy_served(daemon) -> None:
    async with AsyncClient(daemon.url, namespace=jamba_namespace("recheck")) as client:
        pages = [random_page(300 + i) for i in range(2)]
        refs = [await client.put_kv(i, bytes(32), 0, 512, page, request_id="recheck") for i, page in enumerate(pages)]

        async def written_behind() -> bool:
            return (await client.stats())["write_behind_pending"] == 0

        await eventually(written_behind)
        before = daemon.scrape()
        for ref in refs:
            flip_in_daemon_arena(daemon.pid, ref.state_id, from_end=1000)
        # the daemon serves its arena copy without a digest pass; the client's check where the
        # bytes land fails, it asks again in full: the damaged copy is dropped, disk's served
        assert page_bytes(await client.load(refs[0])) == page_bytes(pages[0])
        assert [page_bytes(p) for p in await client.load_many(refs[1:])] == [page_bytes(pages[1])]
        after = daemon.scrape()
        assert after.delta(before, "statetier_rejections_total", reason="corrupt_payload") == 2
        assert page_bytes(await client.load(refs[0])) == page_bytes(pages[0])  # promoted back, intact
