"""End to end, daemon in a subprocess: which put acknowledgement survives a kill -9.

The promise (docs/operations.md, "Durability"): a put whose reply says ``durable`` was on
the disk tier, fdatasync'd, before the reply was sent, and a daemon killed right after
serves it byte-exact when it comes back. A put acknowledged from the host tier alone
(``durable`` false) is a cache entry until the write-behind has copied it down.
"""

from __future__ import annotations

from statetier.clients import AsyncClient, StoredRef
from statetier.launch.daemons import DaemonProcess
from statetier.protocol.identity import StateRef
from tests.support.jamba import assert_same_tensors, jamba_namespace, kv_page

NAMESPACE = jamba_namespace("durability")


async def test_a_put_acknowledged_as_durable_survives_a_kill_right_after_the_reply() -> None:
    with DaemonProcess(name="durable", host_capacity="64MiB") as daemon:
        async with AsyncClient(daemon.url, namespace=NAMESPACE) as client:
            refs = [await client.put_kv(0, bytes([i]) * 32, 0, 16, kv_page(i, 16), request_id=f"d{i}",
                                        durable=True) for i in range(12)]
        daemon.kill()  # no write-behind, no shutdown flush: only what the replies promised
        assert all(isinstance(ref, StoredRef) and ref.durable and ref.tier == "host" for ref in refs)

        daemon.start()
        async with AsyncClient(daemon.url, namespace=NAMESPACE) as client:
            for i, ref in enumerate(refs):
                assert_same_tensors(await client.load(ref), kv_page(i, 16))


async def test_a_put_from_the_host_tier_says_it_is_not_durable_yet_and_still_equals_the_plain_ref() -> None:
    with DaemonProcess(name="cache", host_capacity="64MiB") as daemon:
        async with AsyncClient(daemon.url, namespace=NAMESPACE) as client:
            ref = await client.put_kv(0, bytes(32), 0, 16, kv_page(1, 16), request_id="c")
            assert (ref.tier, ref.durable) == ("host", False)
            plain = StateRef(ref.key, ref.request_id, ref.step, ref.state_id, ref.version, ref.fingerprint)
            assert ref == plain and plain == ref and hash(ref) == hash(plain)
            assert_same_tensors(await client.load(plain), kv_page(1, 16))
