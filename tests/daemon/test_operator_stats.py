"""Issue 41 (4): what an operator sees of hits, misses and refusals, over a real host arena and disk.

Stories: the STATS reply carries the counters (hits per tier and kind, misses, rejections by
reason) and ``statetier stats`` prints them; a refused object is said at INFO once per reason
per interval, naming its state id and reason, however many follow; ``ls`` counts an object
held in host and disk as one object and two copies, as ``stats`` counts copies.
"""

from __future__ import annotations

import logging

import pytest

from statetier.daemon.cli.formatting import format_listing, format_stats
from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.engine.refusal_log import RefusalLog
from statetier.daemon.metrics import Metrics, NullMetrics, counted
from statetier.daemon.requests import LoadRequest
from statetier.protocol.errors import NotFound, PositionMismatch
from statetier.protocol.identity import Kind, StateKey
from statetier.protocol.keyring import Keyring
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.registry import MemoryVersionRegistry
from tests.support.engine_objects import CHAIN, NS, ssm_put
from tests.support.waiting import eventually

REFUSALS = "statetier.daemon.refusals"


@pytest.fixture
async def engine(tmp_path):
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(1 << 20, granularity=4096))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    built = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(), metrics=Metrics(),
                   options=EngineOptions(producer_id="stats"), arena=host, write_behind_to=disk)
    await built.start()
    yield built
    await built.close()


async def shifted_load(engine: Engine, ref) -> None:
    one_off = StateKey(NS, Kind.SSM, 0, CHAIN[3], 0, 63)
    shifted = ref.__class__(one_off, ref.request_id, ref.step, ref.state_id, ref.version)
    with pytest.raises(PositionMismatch):
        await engine.load(LoadRequest("default", NS, ref=shifted), owner="c")


async def test_stats_carry_hits_misses_and_rejections_by_reason_and_the_cli_prints_them(engine):
    put = await engine.put(*ssm_put())
    served = await engine.load(LoadRequest("default", NS, ref=put.ref), owner="c")
    await engine.release(served.lease_id, "c")
    with pytest.raises(NotFound):
        await engine.load(LoadRequest("default", NS, key=StateKey(NS, Kind.SSM, 1, CHAIN[3], 0, 64)), owner="c")
    await shifted_load(engine, put.ref)
    await shifted_load(engine, put.ref)

    counters = engine.stats()["counters"]
    assert counters["hits"]["host"]["ssm"] == 1
    assert counters["misses"] == {"kv": 0, "ssm": 1}
    assert counters["rejections"]["position"] == 2 and counters["rejections"]["bad_signature"] == 0
    assert counters["outage_served"] == {"load": 0, "put": 0, "lookup": 0}
    printed = format_stats(engine.stats())
    assert "  hits: host ssm 1" in printed
    assert "  misses: ssm 1" in printed
    assert "  rejections: position 2" in printed
    assert counted(NullMetrics()) == {}


async def test_a_refusal_is_said_at_info_once_per_reason_per_interval_with_its_object(engine, caplog):
    put = await engine.put(*ssm_put())
    with caplog.at_level(logging.INFO, logger=REFUSALS):
        for _ in range(3):
            await shifted_load(engine, put.ref)
    records = [r for r in caplog.records if r.name == REFUSALS]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert put.ref.state_id.hex() in records[0].getMessage() and "position" in records[0].getMessage()


def test_the_refusal_log_says_how_many_it_held_back_once_the_interval_passed(caplog) -> None:
    now = [0.0]
    refusals = RefusalLog(interval=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=REFUSALS):
        said = [refusals.note(PositionMismatch("one off"), bytes(16)) for _ in range(4)]
        said.append(refusals.note(NotFound("other reason"), None))
        now[0] = 61.0
        said.append(refusals.note(PositionMismatch("one off"), bytes(16)))
    assert said == [True, False, False, False, True, True]
    assert len(caplog.records) == 3
    assert "3 more of this reason" in caplog.records[-1].getMessage()


async def test_ls_counts_objects_and_copies_apart(engine):
    await engine.put(*ssm_put())
    await eventually(lambda: engine.stats()["copies"] == 2, "the copy on disk", timeout=10)  # host, and disk behind it
    (row,) = (await engine.list_objects("default"))["namespaces"]
    assert (row["objects"], row["copies"]) == (1, 2)
    header, line = format_listing({"namespaces": [row]}).splitlines()[:2]
    assert header.split()[2:4] == ["objects", "copies"] and line.split()[2:4] == ["1", "2"]


def test_stats_print_peer_pulls_losses_and_fences_and_outage_served_counts() -> None:
    reply = {"tiers": [{"tier": "host", "objects": 1, "bytes_used": 10, "capacity": 100},
                       {"tier": "peer", "objects": 0, "extra": {"pulls": 9, "pulls_lost": 1, "owners_fenced": 1,
                                                                "served": 4, "refused": 0}}],
             "counters": {"hits": {"peer": {"kv": 9}}, "misses": {"kv": 0, "ssm": 0}, "rejections": {},
                          "outage_served": {"load": 4, "put": 0, "lookup": 2}},
             "registry_heads_behind": 3}
    printed = format_stats(reply)
    assert "  hits: peer kv 9" in printed
    assert "  peers: pulls 9, lost 1, owners fenced 1, served 4, refused 0" in printed
    assert "  served while Redis was unreachable: load 4, lookup 2" in printed
    assert "  registry heads behind (fenced): 3;" in printed
