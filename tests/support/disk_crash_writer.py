"""A disk-tier writer run as a subprocess by the crash and full-filesystem tests.

- ``make_object(object_id)`` — the sealed object for an id, derived from the id alone
  (size, payload, key, created-at), so a test knows exactly which bytes to expect.
- ``object_id_for(seed, run, index)`` — the id of the index-th object of one run.
- ``crash_size(object_id)`` — the size the crash writer gives it: mostly small objects
  (buffered, written by the commit), one in eight past ``BUFFERED_BYTES`` (written by
  ``write`` itself, in a segment of its own).
- ``python -m tests.support.disk_crash_writer crash DIR SEED RUN`` (from the checkout's
  root) — opens the tier (checkpointing the index after every op, every few ops, or never:
  chosen per run), prints ``READY <entries dropped by recovery> <objects re-indexed from
  the log>``, then stores objects
  from three concurrent writers forever, deleting and compacting now and then. It prints
  (flushed) ``S <id>`` right after ``complete_store`` returns, ``d <id>`` before a
  ``delete`` and ``D <id>`` right after it returns, until the test kills it with SIGKILL.
- ``python -m tests.support.disk_crash_writer fill DIR LIMIT`` — caps its file size at
  LIMIT bytes (RLIMIT_FSIZE, SIGXFSZ ignored) and stores until the tier says ``CapacityError``, then
  checks in-process that nothing broke: prints ``S <id>`` per stored object,
  ``FULL <id> <error class>`` for the refused one, ``DELETED <id> <log fallbacks>`` once
  it deleted the first object (a delete must work on a full disk), ``OK`` when every other
  earlier object still read back verified and the refused one left nothing visible.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import CapacityError
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import dev_keyring
from statetier.protocol.sealed import decode_header, seal_object
from statetier.tiers.base import ObjectMeta

KEYRING = dev_keyring(b"disk-tier-tests")
NAMESPACE = NamespaceSpec("disk-tier-test").namespace()


def object_id_for(seed: int, run: int, index: int) -> bytes:
    return hashlib.blake2b(f"{seed}/{run}/{index}".encode(), digest_size=16).digest()


def crash_size(object_id: bytes) -> int:
    from statetier.tiers.disk.stores import BUFFERED_BYTES

    rng = random.Random(object_id + b"size")
    return BUFFERED_BYTES + rng.randrange(1, 64 * 1024) if rng.random() < 0.125 else rng.randrange(256, 24 * 1024)


def make_object(object_id: bytes, size: int | None = None) -> tuple[ObjectMeta, bytes]:
    """The sealed object (and its metadata) that ``object_id`` stands for."""
    rng = random.Random(object_id)
    size = size if size is not None else rng.randrange(256, 24 * 1024)
    key = StateKey(NAMESPACE, Kind.KV, object_id[0] % 4, hashlib.sha256(object_id).digest(), 0, 16)
    provenance = Provenance(f"req-{object_id.hex()[:8]}", 0, "disk-test", int.from_bytes(object_id[:6], "little"))
    blob = seal_object(key, provenance, [(TensorSpec("kv", "uint8", (size,)), rng.randbytes(size))],
                       keyring=KEYRING, state_id=object_id, version=1)
    return ObjectMeta.from_header(decode_header(blob)), blob


async def store(tier, meta: ObjectMeta, blob: bytes) -> None:
    ticket = await tier.prepare_store(meta)
    ok = False
    try:
        await tier.write(ticket, [blob[: meta.header_len], memoryview(blob)[meta.header_len :]])
        await tier.complete_store(ticket, True)
        ok = True
    finally:
        if not ok:
            await tier.complete_store(ticket, False)


async def load(tier, object_id: bytes) -> bytes:
    lease = await tier.prepare_load(object_id, owner="writer")
    try:
        return bytes(await tier.read(lease))
    finally:
        await tier.complete_load(lease)


def _say(*words: str) -> None:
    sys.stdout.write(" ".join(words) + "\n")
    sys.stdout.flush()


def open_tier(directory: str, **options):
    from statetier.tiers.disk import DiskTier, DiskTierOptions

    options.setdefault("segment_bytes", 256 * 1024)
    return DiskTier(DiskTierOptions(directory, 1 << 30, **options), keyring=KEYRING)


async def crash_loop(directory: str, seed: int, run: int) -> None:
    rng = random.Random(seed * 1000 + run)
    tier = open_tier(directory, checkpoint_ops=rng.choice([1, 5, 40, 1 << 30]),
                     checkpoint_seconds=rng.choice([0.02, 3600.0]))
    await tier.start()
    extra = tier.stats().extra
    _say("READY", str(extra["recovery_dropped"]), str(extra["recovery_replayed"]))
    mine: list[bytes] = []
    counter = iter(range(1 << 30))

    async def writer() -> None:
        while True:
            object_id = object_id_for(seed, run, next(counter))
            await store(tier, *make_object(object_id, crash_size(object_id)))
            _say("S", object_id.hex())
            mine.append(object_id)
            if rng.random() < 0.25 and mine:
                victim = mine.pop(rng.randrange(len(mine)))
                _say("d", victim.hex())
                if await tier.delete(victim):
                    _say("D", victim.hex())
            if rng.random() < 0.05:
                await tier.compact()

    await asyncio.gather(writer(), writer(), writer())


async def fill(directory: str, limit: int) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    tier = open_tier(directory, segment_bytes=64 << 20)
    await tier.start()
    stored: dict[bytes, bytes] = {}
    for index in range(100_000):
        object_id = object_id_for(7, 0, index)
        meta, blob = make_object(object_id, 48 * 1024)
        try:
            await store(tier, meta, blob)
        except CapacityError as exc:
            _say("FULL", object_id.hex(), type(exc).__name__)
            assert not await tier.contains(object_id)
            assert tier.stats().extra["reserved_bytes"] == 0
            break
        stored[object_id] = blob
        _say("S", object_id.hex())
    first = next(iter(stored))
    assert await tier.delete(first)
    del stored[first]
    _say("DELETED", first.hex(), str(tier.stats().extra["log_fallbacks"]))
    for object_id, blob in stored.items():
        assert await load(tier, object_id) == blob
    await tier.close()
    _say("OK")


def main(argv: list[str]) -> None:
    mode, directory = argv[1], argv[2]
    if mode == "crash":
        asyncio.run(crash_loop(directory, int(argv[3]), int(argv[4])))
    elif mode == "fill":
        asyncio.run(fill(directory, int(argv[3])))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv)
