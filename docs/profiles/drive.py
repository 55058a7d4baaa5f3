"""Drive one request kind against a private daemon, for ``py-spy record`` on both processes.

``python docs/profiles/drive.py OP SECONDS READY_FILE`` — OP is ``ping``, ``put64k``,
``load64k`` or ``lookup`` (1 attention + 1 SSM layer, 1 boundary, leased and released as the
bench does). It starts ``statetier serve`` (host tier only, as ``statetier bench sdk``),
warms up, writes ``<daemon pid> <own pid>`` to READY_FILE, runs OP back to back for SECONDS,
then prints how many requests it made. ``docs/profiles/profile.sh`` runs it under py-spy;
``summarize.py`` turns py-spy's raw stacks into the top-N tables in this folder.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import uvloop
from statetier.benchmarks.procs import own_daemon, process_cpu_seconds
from statetier.clients import AsyncClient
from statetier.protocol.identity import NamespaceSpec, prefix_hash


async def main(op: str, seconds: float, ready: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="st-prof-", dir="/tmp") as directory:
        async with own_daemon(Path(directory)) as daemon:
            spec = NamespaceSpec(f"profile/{os.getpid()}", kv_block_size=16, kv_dtype="bfloat16")
            async with AsyncClient(daemon.url, namespace=spec, use_shm=op in ("put64k", "load64k")) as client:
                call = await _call(client, op)
                for _ in range(300):
                    await call()
                ready.write_text(f"{daemon.pid} {os.getpid()}\n")
                count, ends = 0, time.perf_counter() + seconds
                cpu = process_cpu_seconds(daemon.pid), time.process_time()
                while time.perf_counter() < ends:
                    await call()
                    count += 1
                daemon_cpu = (process_cpu_seconds(daemon.pid) - cpu[0]) / count * 1e6
                client_cpu = (time.process_time() - cpu[1]) / count * 1e6
                print(f"{op}: {count} requests in {seconds:g} s ({seconds / count * 1e6:.0f} us each; CPU per "
                      f"request: daemon {daemon_cpu:.0f} us, client {client_cpu:.0f} us; load "
                      f"{os.getloadavg()[0]:.2f})", flush=True)


async def _call(client, op: str):
    prefix = prefix_hash(list(range(16)))
    page = {"kv": torch.randn(2, 8, 16, 128).to(torch.bfloat16)}
    if op == "ping":
        return client.ping
    if op == "put64k":
        serial = iter(range(1 << 40))
        return lambda: client.put_kv(0, prefix, 0, 16, page, request_id=f"p{next(serial)}")
    ref = await client.put_kv(0, prefix, 0, 16, page, request_id="profile")
    if op == "load64k":
        into = {"kv": torch.empty_like(page["kv"])}
        return lambda: client.load(ref, into=into)
    await client.put_ssm(1, prefix, 16, {"conv": torch.randn(3, 8192).to(torch.bfloat16),
                                         "ssm": torch.randn(8192, 16)}, request_id="profile")

    async def lookup() -> None:
        found = await client.lookup([0], [1], [(16, prefix)])
        assert found.tokens == 16
        await client.release(found.lease_ids)
    return lookup


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])))
