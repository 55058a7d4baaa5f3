"""A worker of one tenant, as a uid of its own: ``python tenant_worker.py JOB JSON``.

Started as root by the ownership and isolation tests, it imports everything it will use,
then drops to the uid, gid and supplementary groups ``JSON`` names (fork + setuid, the way a
deployment's worker runs under its own user in the daemon's group), and only then
connects. It prints one JSON line. Jobs (``JSON`` holds ``url``, ``uid``, ``gid``,
``groups`` and the job's own fields):

- ``put`` — ``model``, ``tenant_in_spec``, ``seed``: one 64 KiB KV page put (durable and
  published when the daemon has Redis), loaded back; prints the ref (wire form) and the
  page's first 64 payload bytes as ``probe`` (hex). With ``hold_seconds`` it then keeps the
  connection open that long (printing ``{"holding": true}`` first).
- ``find`` — ``model``, ``tenant_in_spec``, ``ref`` (another worker's, wire form): load by
  key, load by that ref, and a lookup, each reported as ``"bytes"`` or the error's reason.
- ``scan`` — ``probe`` (hex), ``roots``, ``pids``: every file under ``roots`` and in
  ``/dev/shm`` it can open, every descriptor in ``/proc/<pid>/fd`` and every mapping in
  ``/proc/<pid>/mem`` of ``pids`` it can read, searched for the probe; prints what it
  could open (counts) and where it found the probe.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import mmap  # noqa: F401 - the SDK maps its windows after the privileges are dropped
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script from anywhere: find the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import statetier.clients.copies  # noqa: F401 - loaded before setuid: nothing below may import late
import statetier.clients.shm  # noqa: F401
from statetier.clients import AsyncClient
from statetier.protocol.errors import StatetierError
from statetier.protocol.identity import NamespaceSpec, prefix_hashes
from statetier.protocol.messages import ref_from_wire, ref_to_wire

BLOCK = 16
TOKENS = list(range(1000, 1000 + BLOCK))


def spec_of(job: dict) -> NamespaceSpec:
    return NamespaceSpec(model_id=job["model"], kv_block_size=BLOCK, tenant=job["tenant_in_spec"])


def page(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(-2**31, 2**31 - 1, (16, 1024), generator=gen, dtype=torch.int32)}


def drop_privileges(job: dict) -> None:
    os.setgroups(job["groups"])
    os.setgid(job["gid"])
    os.setuid(job["uid"])


async def put(job: dict) -> None:
    tensors = page(job["seed"])
    prefix = prefix_hashes(TOKENS, BLOCK)[-1]
    async with AsyncClient(job["url"], namespace=spec_of(job)) as client:
        has_redis = any(t["tier"] == "redis" for t in (await client.stats())["tiers"])
        ref = await client.put_kv(0, prefix, 0, BLOCK, tensors, request_id=f"req-{job['seed']}",
                                  durable=True, publish=has_redis)
        assert torch.equal((await client.load(ref))["kv"], tensors["kv"])
        raw = tensors["kv"].numpy().tobytes()
        print(json.dumps({"ref": ref_to_wire(ref), "probe": raw[4096 : 4096 + 64].hex(),
                          "uses_shm": client.uses_shm}), flush=True)
        if job.get("hold_seconds"):
            print(json.dumps({"holding": True}), flush=True)
            await asyncio.sleep(job["hold_seconds"])


async def outcome(call) -> str:
    try:
        result = await call
    except StatetierError as exc:
        return exc.reason
    if hasattr(result, "tokens"):
        return f"tokens:{result.tokens}"
    return "bytes"


async def find(job: dict) -> None:
    prefix = prefix_hashes(TOKENS, BLOCK)[-1]
    async with AsyncClient(job["url"], namespace=spec_of(job)) as client:
        key = client.kv_key(0, prefix, 0, BLOCK)
        print(json.dumps({
            "by_key": await outcome(client.load(key)),
            "by_ref": await outcome(client.load(ref_from_wire(job["ref"]))),
            "by_lookup": await outcome(client.lookup([0], [], token_ids=TOKENS, lease=False)),
        }), flush=True)


def scan(job: dict) -> None:
    probe = bytes.fromhex(job["probe"])
    opened, found = 0, []
    paths = [p for root in job["roots"] + ["/dev/shm"] for p in _walk(Path(root))]
    for pid in job["pids"]:
        paths += list(_listing(Path(f"/proc/{pid}/fd")))
    for path in paths:
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        opened += 1
        if probe in data:
            found.append(str(path))
    mapped = 0
    for pid in job["pids"]:
        mapped += _search_memory(pid, probe, found)
    print(json.dumps({"opened": opened, "memory_read": mapped, "found": found}), flush=True)


def _walk(root: Path):
    for path in _listing(root):
        if path.is_dir() and not path.is_symlink():
            yield from _walk(path)
        else:
            yield path


def _listing(directory: Path):
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def _search_memory(pid: int, probe: bytes, found: list[str]) -> int:
    """Bytes of ``pid``'s readable mappings this process could read."""
    read = 0
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb")
    except OSError:
        return 0
    with mem:
        for line in maps:
            fields = line.split()
            if fields[1][0] != "r":
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except (OSError, OverflowError, ValueError):
                continue
            read += len(data)
            if probe in data:
                found.append(f"/proc/{pid}/mem {line}")
    return read


def main() -> None:
    name, job = sys.argv[1], json.loads(sys.argv[2])
    hashlib.sha256(b"")  # hashlib's C module loaded before setuid
    drop_privileges(job)
    if name == "scan":
        scan(job)
    else:
        asyncio.run({"put": put, "find": find}[name](job))


if __name__ == "__main__":
    main()
