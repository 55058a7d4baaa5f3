"""A worker of one tenant, as a uid of its own: ``python -m tests.support.tenant_worker JOB JSON``.

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
- ``put_groups`` — ``model``, ``tenant_in_spec``, ``seed``: one request's state in group
  objects (``GROUP_BLOCKS`` KV group objects, one SSM group object), durable, in one
  ``put_many``; prints their refs (wire form).
- ``find_groups`` — ``model``, ``tenant_in_spec``, ``refs`` (another worker's ``put_groups``
  refs), ``seeds``: the objects' keys loaded as one ``load_many`` (one frame in flight:
  ``load_batch_frames`` counts its frames, more than one when it streamed through the load
  window) and one chosen layer by key, each reported as ``"seed:N"`` (the bytes of seed N of
  ``seeds``), ``"other"`` or the error's reason; the refs as one ``load_many`` and one
  chosen layer by ref, and a lookup over the groups, as ``find`` reports them.
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

import torch

import statetier.clients.copies  # noqa: F401 - loaded before setuid: nothing below may import late
import statetier.clients.shm  # noqa: F401
from statetier.clients import AsyncClient, LayerGroup, PutItem
from statetier.protocol.errors import StatetierError
from statetier.protocol.frames import Op
from statetier.protocol.identity import Kind, NamespaceSpec, prefix_hashes
from statetier.protocol.messages import ref_from_wire, ref_to_wire

BLOCK = 16
TOKENS = list(range(1000, 1000 + BLOCK))


GROUP_BLOCKS = 4
GROUP_TOKENS = list(range(2000, 2000 + GROUP_BLOCKS * BLOCK))
ATTENTION = LayerGroup(Kind.KV, 0, (0, 1))
MAMBA = LayerGroup(Kind.SSM, 1, (2, 3))


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
            await asyncio.sleep(job["hold_seconds"])  # the behaviour: a live connection, until the test kills it


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


def group_items(client: AsyncClient, seed: int) -> list[PutItem]:
    """A KV group object (512 KiB: two layers' ``k`` and ``v``) per block and the SSM group
    object (256 KiB) at the last boundary, their bytes drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    chain = prefix_hashes(GROUP_TOKENS, BLOCK)

    def regions(group: LayerGroup, rows: int) -> dict[int, dict[str, torch.Tensor]]:
        return {layer: {name: torch.randint(-2**15, 2**15 - 1, (rows, 512), generator=gen, dtype=torch.int16)
                        for name in ("k", "v")} for layer in group.layers}

    items = [PutItem(client.group_key(ATTENTION, chain[b], b * BLOCK, (b + 1) * BLOCK), regions(ATTENTION, 128),
                     request_id=f"groups-{seed}", durable=True) for b in range(GROUP_BLOCKS)]
    items.append(PutItem(client.group_key(MAMBA, chain[-1], 0, GROUP_BLOCKS * BLOCK), regions(MAMBA, 64),
                         request_id=f"groups-{seed}", durable=True))
    return items


async def put_groups(job: dict) -> None:
    async with AsyncClient(job["url"], namespace=spec_of(job)) as client:
        refs = await client.put_many(group_items(client, job["seed"]))
        print(json.dumps({"refs": [ref_to_wire(ref) for ref in refs]}), flush=True)


def same(got: dict, want: dict) -> bool:
    return sorted(got) == sorted(want) and all(
        list(got[layer]) == list(want[layer]) and all(torch.equal(got[layer][n], t) for n, t in want[layer].items())
        for layer in want)


async def matched(call, wanted: dict[int, list[dict]]) -> str:
    """``"seed:N"`` when what ``call`` loaded is seed N's objects, ``"other"``, or the reason."""
    try:
        got = await call
    except StatetierError as exc:
        return exc.reason
    got = got if isinstance(got, list) else [got]
    return next((f"seed:{seed}" for seed, want in wanted.items()
                 if len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))), "other")


async def find_groups(job: dict) -> None:
    async with AsyncClient(job["url"], namespace=spec_of(job)) as client:
        wanted = {seed: [item.tensors for item in group_items(client, seed)] for seed in job["seeds"]}
        keys = [item.key for item in group_items(client, 0)]
        refs = [ref_from_wire(ref) for ref in job["refs"]]
        conn, frames = client._connection(), []
        send = conn.request

        async def counted(op, meta, *args, **kwargs):
            frames.append(op)
            return await send(op, meta, *args, **kwargs)

        conn.request = counted
        by_key = await matched(client.load_many(keys, concurrency=1), wanted)
        load_batch_frames = frames.count(Op.LOAD_BATCH)
        print(json.dumps({
            "uses_shm": client.uses_shm,
            "batch_by_key": by_key,
            "load_batch_frames": load_batch_frames,
            "layer_by_key": await matched(client.load_group(keys[-1], layers=[3]),
                                          {seed: [{3: want[-1][3]}] for seed, want in wanted.items()}),
            "batch_by_ref": await outcome(client.load_many(refs)),
            "layer_by_ref": await outcome(client.load_group(refs[1], layers=[1])),
            "by_lookup": await outcome(client.lookup(groups=[ATTENTION, MAMBA], token_ids=GROUP_TOKENS,
                                                     lease=False)),
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
        asyncio.run({"put": put, "find": find, "put_groups": put_groups, "find_groups": find_groups}[name](job))


if __name__ == "__main__":
    main()
