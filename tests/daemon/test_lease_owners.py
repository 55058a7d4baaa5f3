"""Issue 42, item 5: a load's lease has one owner, and is released exactly once.

Over a real Server and Engine (``server_harness``): an inline LOAD (its reply owns the
lease until the transport let go of the bytes), a LOAD into the shared-memory window (the
reply owns it too), a LOAD whose tensor specs do not match (the engine gives the lease
back itself: the error path), a LOAD_BATCH, and a LOAD whose client went away while it
waited for the byte budget (a dropped connection). ``Engine.lease_releases`` counts the
lease ids asked to be released and the leases released: each grows by exactly one per
load, and no lease is left.
"""

from __future__ import annotations

import os

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.frames import Frame, Op
from statetier.protocol.wire_meta import LoadAnswer, LoadBatchMeta, LoadBatchReply, LoadMeta, PutAnswer, wire_specs
from tests.support.server_harness import NS, answer, load_meta, put_meta, running_daemon
from tests.support.waiting import eventually


async def test_every_load_gives_its_lease_back_exactly_once() -> None:
    async with running_daemon(limits={"byte_budget": 4 << 20, "busy_wait_seconds": 60}) as daemon:
        client = await daemon.unix_client()
        assert (await client.hello(shm=True)).op is Op.HELLO_OK
        meta, size = put_meta(shape=(256, 1024))  # 512 KiB
        ref = answer(await client.request(Op.PUT, meta, os.urandom(size)), PutAnswer).ref
        engine = daemon.engine
        assert engine.lease_releases == (0, 0)

        inline = await client.request(Op.LOAD, load_meta(ref=ref))
        assert answer(inline, LoadAnswer).window is None
        await eventually(lambda: engine.lease_releases == (1, 1))

        windowed = await client.request(Op.LOAD, LoadMeta(NS.digest, ref=ref, shm=True))
        assert answer(windowed, LoadAnswer).window is not None
        await eventually(lambda: engine.lease_releases == (2, 2))

        wrong = wire_specs([TensorSpec("k", "float16", (16, 64))])
        mismatch = await client.request(Op.LOAD, LoadMeta(NS.digest, ref=ref, tensors=wrong))
        assert mismatch.is_error and mismatch.meta["reason"] == "destination_mismatch"
        assert engine.lease_releases == (3, 3)

        batch = await client.request(Op.LOAD_BATCH, LoadBatchMeta(NS.digest, (LoadMeta(ref=ref), LoadMeta(ref=ref))))
        assert all(item.error is None for item in answer(batch, LoadBatchReply).items)
        assert engine.lease_releases == (5, 5)

        budget = daemon.server.budget
        await budget.acquire(budget.limit)  # the next inline load leases, then waits to send
        client.send(Frame(Op.LOAD, 99, load_meta(ref=ref)))
        await eventually(lambda: daemon.leases() == 1 and budget.waiting == 1)
        await client.close()
        await eventually(lambda: daemon.server.stats()["connections"] == 0)
        budget.release(budget.limit)
        assert engine.lease_releases == (6, 6) and daemon.leases() == 0
