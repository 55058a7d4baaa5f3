"""One load-probe client process: mixed put, lookup, load, delete with random sizes for a
given time, every loaded byte checked. Imports no torch (``wire.py``).

``python load_worker.py URL INDEX SECONDS OUT.json`` writes
``{"ops": {op: [latency_s, …]}, "errors": {reason: n}, "wrong": n}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import time

from statetier.protocol.errors import StatetierError
from wire import Wire

SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10)
MAX_OPS = 1_000_000


def _payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


async def main(url: str, index: int, seconds: float, out: str) -> None:
    rng = random.Random(index)
    wire = await Wire.open(url, model=f"load-{index % 4}")
    ops: dict[str, list[float]] = {"put": [], "load": [], "lookup": [], "delete": []}
    errors: dict[str, int] = {}
    wrong = 0
    mine: list[tuple[int, int, dict]] = []
    deadline = time.monotonic() + seconds
    for n in range(MAX_OPS):
        if time.monotonic() > deadline:
            break
        pick = rng.random()
        started = time.perf_counter()
        try:
            if pick < 0.35 or not mine:
                seed, size = index * 10_000_000 + n, rng.choice(SIZES)
                prefix = hashlib.sha256(f"load:{seed}".encode()).digest()
                reply = await wire.put(wire.key(index % 8, prefix), _payload(seed, size), request_id=f"w{index}-{n}")
                op = "put"
                mine.append((seed, size, reply["ref"]))
            elif pick < 0.75:
                seed, size, ref = rng.choice(mine)
                op = "load"
                if await wire.load(ref=ref) != _payload(seed, size):
                    wrong += 1
            elif pick < 0.9:
                seed, size, ref = rng.choice(mine)
                op = "lookup"
                await wire.lookup([index % 8], bytes.fromhex(ref["key"]["prefix"]), lease=False)
            else:
                seed, size, ref = mine.pop(rng.randrange(len(mine)))
                op = "delete"
                await wire.delete(ref)
            ops[op].append(time.perf_counter() - started)
        except StatetierError as exc:
            errors[exc.reason] = errors.get(exc.reason, 0) + 1
            if exc.reason == "not_found":  # evicted under the host and disk capacity: allowed
                mine = [m for m in mine if m[0] != seed]
    await wire.close()
    with open(out, "w") as handle:
        json.dump({"ops": ops, "errors": errors, "wrong": wrong}, handle)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
