"""A load whose destination does not match the stored object is the caller's error, not damage.

``into`` tensors (or ``expect`` specs) of other names, dtypes or shapes get
``DestinationMismatch`` (wire code 411): never ``CorruptPayload``, never counted as a
rejection or a damaged candidate, the caller's buffers untouched and the stored copy left
where it is: the same object then loads into a destination that matches.
"""

from __future__ import annotations

import pytest
import torch

from statetier.clients import AsyncClient, Client
from statetier.launch import DaemonProcess
from statetier.protocol.errors import CorruptPayload, DestinationMismatch, InvalidRequest, error_from_code
from statetier.protocol.identity import NamespaceSpec

DAMAGE_REASONS = ("truncated", "malformed", "bad_signature", "unsupported_format", "corrupt_payload")


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(name="destinations", host_capacity="64MiB") as running:
        yield running


def namespace(label: str) -> NamespaceSpec:
    return NamespaceSpec(model_id=f"org/dest-{label}", kv_block_size=16, kv_dtype="bfloat16", ssm_dtype="float32",
                         conv_dtype="bfloat16", conv_layout="(3,256)")


def snapshot(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"conv": torch.randn(3, 256, generator=gen).to(torch.bfloat16), "ssm": torch.randn(256, 16, generator=gen)}


def wrong_destinations() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "shape": {"conv": torch.full((3, 255), 7, dtype=torch.bfloat16), "ssm": torch.full((256, 16), 7.0)},
        "dtype": {"conv": torch.full((3, 256), 7, dtype=torch.float16), "ssm": torch.full((256, 16), 7.0)},
        "size": {"conv": torch.full((3, 256), 7, dtype=torch.bfloat16), "ssm": torch.full((256, 8), 7.0)},
        "names": {"conv": torch.full((3, 256), 7, dtype=torch.bfloat16), "state": torch.full((256, 16), 7.0)},
        "missing": {"conv": torch.full((3, 256), 7, dtype=torch.bfloat16)},
    }


def untouched(into: dict[str, torch.Tensor]) -> bool:
    return all(bool((tensor == 7).all()) for tensor in into.values())


async def holders(client: AsyncClient, refs) -> list[set[str]]:
    """The tiers holding each object (write-behind may add a lower one meanwhile)."""
    return [set((await client.inspect(ref.state_id))["tiers"]) for ref in refs]


def refusals(samples) -> dict[str, float]:
    """What would say the stored bytes were refused or dropped: every damage reason."""
    counted = {f"rejected {reason}": samples.value("statetier_rejections_total", reason=reason)
               for reason in DAMAGE_REASONS}
    counted["skipped damaged"] = samples.value("statetier_skipped_candidates_total", reason="damaged")
    return counted


def test_the_error_has_its_own_wire_code_and_is_no_rejection() -> None:
    error = error_from_code(DestinationMismatch.code, "into differs")
    assert type(error) is DestinationMismatch and error.code == 411 and error.reason == "destination_mismatch"
    assert isinstance(error, InvalidRequest) and not isinstance(error, CorruptPayload)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "inline"])
async def test_a_mismatched_into_is_a_destination_mismatch_and_the_object_stays_loadable(daemon, use_shm: bool) -> None:
    want = snapshot(seed=3)
    async with AsyncClient(daemon.url, namespace=namespace(f"ref-{use_shm}"), use_shm=use_shm) as client:
        ref = await client.put_ssm(0, bytes(32), 64, want, request_id="dest")
        before = daemon.scrape()
        wrong = wrong_destinations()
        for why, into in wrong.items():
            with pytest.raises(DestinationMismatch):
                await client.load(ref, into=into)
            assert untouched(into), why
        with pytest.raises(DestinationMismatch):  # a consumer's stated specs: the same error
            await client.load(ref, expect={"conv": ("bfloat16", (3, 255)), "ssm": ("float32", (256, 16))})
        after = daemon.scrape()
        assert refusals(after) == refusals(before)
        assert after.delta(before, "statetier_errors_total", reason="destination_mismatch") == len(wrong) + 1
        assert after.delta(before, "statetier_errors_total", reason="corrupt_payload") == 0

        right = {"conv": torch.zeros(3, 256, dtype=torch.bfloat16), "ssm": torch.zeros(256, 16)}
        got = await client.load(ref, into=right)
        assert got["conv"] is right["conv"] and got["ssm"] is right["ssm"]
        assert all(torch.equal(right[name], want[name]) for name in want)
        assert refusals(daemon.scrape()) == refusals(before)


async def test_a_mismatched_into_by_key_and_in_a_batch_leaves_every_copy_in_place(daemon) -> None:
    spec = namespace("batch")
    wants = [snapshot(seed=10 + i) for i in range(3)]
    async with AsyncClient(daemon.url, namespace=spec) as client:
        refs = [await client.put_ssm(i, bytes(32), 64, want, request_id="dest-batch") for i, want in enumerate(wants)]
        held = await holders(client, refs)
        assert all(held)
        before = daemon.scrape()
        key = client.ssm_key(0, bytes(32), 64)
        with pytest.raises(DestinationMismatch):
            await client.load(key, into=wrong_destinations()["shape"])
        intos = [{"conv": torch.zeros(3, 256, dtype=torch.bfloat16), "ssm": torch.zeros(256, 16)} for _ in refs]
        intos[1] = wrong_destinations()["dtype"]
        with pytest.raises(DestinationMismatch) as info:
            await client.load_many(refs, into=intos)
        assert info.value.detail["item"] == 1 and untouched(intos[1])
        assert refusals(daemon.scrape()) == refusals(before)
        assert all(before <= after for before, after in zip(held, await holders(client, refs)))  # none dropped

        intos[1] = {"conv": torch.zeros(3, 256, dtype=torch.bfloat16), "ssm": torch.zeros(256, 16)}
        loaded = await client.load_many(refs, into=intos)
        for got, want in zip(loaded, wants):
            assert all(torch.equal(got[name], want[name]) for name in want)


def test_the_blocking_client_raises_it_too(daemon) -> None:
    with Client(daemon.url, namespace=namespace("sync")) as client:
        ref = client.put_ssm(0, bytes(32), 64, snapshot(seed=4), request_id="dest-sync")
        into = wrong_destinations()["size"]
        with pytest.raises(DestinationMismatch):
            client.load(ref, into=into)
        assert untouched(into)
        assert torch.equal(client.load(ref)["ssm"], snapshot(seed=4)["ssm"])
