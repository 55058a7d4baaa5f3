"""The chaos probes' own logic (``reliability/``), without running a chaos run:

- a result is clean only without any violation, and the table and page say which;
- every fuzz mutation is something the daemon's decoder answers with frames or a typed
  protocol error — the property the fuzz probe relies on to call anything else a bug;
- the corruption probe's map of records matches what a real disk tier wrote, and the
  objects it calls damaged are exactly the ones the tier then refuses.
"""

from __future__ import annotations

import random

import chaos_report
import probe_corruption
import probe_fuzz
import pytest
from harness import ProbeResult

from statetier.protocol.errors import NotFound, ProtocolError, RejectedState
from statetier.protocol.frames import PROTOCOL_VERSIONS, Frame, FrameDecoder, encode_frame_bytes, hello_frame
from statetier.protocol.identity import Kind, StateKey, StateRef
from statetier.protocol.messages import ref_to_wire
from statetier.tiers.disk import DiskTier, DiskTierOptions
from tests.support.disk_crash_writer import KEYRING, load, make_object, object_id_for, store


def result(**counts) -> ProbeResult:
    found = ProbeResult("crash", "a promise", "lost means", "wrong means", inputs=10, faults=2)
    for name, value in counts.items():
        setattr(found, name, value)
    return found


@pytest.mark.parametrize("violation", ["lost", "wrong", "crashes", "hangs", "internal_errors"])
def test_any_violation_fails_the_row(violation):
    dirty = result(**{violation: 1})
    assert not dirty.is_clean and result().is_clean
    assert chaos_report.table([dirty]).split()[-1] == "FAIL"
    assert chaos_report.table([result()]).split()[-1] == "ok"


def test_a_listed_failure_fails_the_row_and_is_printed():
    found = result()
    found.fail("seed 7 served different bytes")
    assert not found.is_clean
    assert "crash: seed 7 served different bytes" in chaos_report.table([found])


def test_the_page_states_each_promise_and_what_lost_and_wrong_mean():
    found = result()
    found.notes["daemon_kills"] = 3
    snapshot = {"load_average": (1.0, 2.0, 3.0), "busiest": [{"name": "pytest", "cpu_percent": 90.0}]}
    page = chaos_report.markdown([found], {"commit": "abc", "started": "2026-01-01 00:00", "minutes": 20,
                                           "seconds": 1200, "machine": "2 CPUs", "load_before": snapshot,
                                           "load_after": snapshot})
    assert "**Promise checked:** a promise." in page
    assert "- **lost** means: lost means." in page and "- **wrong** means: wrong means." in page
    assert "| daemon_kills | 3 |" in page and "load average 1.00 / 2.00 / 3.00" in page and "commit `abc`" in page


def _decode_all(raw: bytes) -> None:
    FrameDecoder(1 << 20).feed(raw)


def test_every_fuzz_input_is_frames_or_a_protocol_error_for_the_decoder():
    rng = random.Random(5)
    ref = StateRef(StateKey(probe_fuzz.NS, Kind.KV, 0, bytes(32), 0, 16), "r", 0, bytes.fromhex("11" * 16), 1)
    templates = probe_fuzz.Templates([ref_to_wire(ref)])
    hello = encode_frame_bytes(hello_frame(PROTOCOL_VERSIONS, tenant="default"))
    outcomes = {"frames": 0, "protocol_error": 0}
    for _ in range(2000):
        op, meta, data, flags = templates.request(rng)
        try:
            frame = encode_frame_bytes(Frame(op, 1, meta, data, flags))
        except ProtocolError:
            continue
        for raw in (frame, probe_fuzz._frame_mutation(rng, frame), probe_fuzz._frame_mutation(rng, hello)):
            try:
                _decode_all(raw)
                outcomes["frames"] += 1
            except ProtocolError:
                outcomes["protocol_error"] += 1
    assert outcomes["frames"] > 1000 and outcomes["protocol_error"] > 200


async def test_the_corruption_map_and_damage_match_what_the_disk_tier_refuses(tmp_path):
    tier = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=64 << 10), keyring=KEYRING)
    await tier.start()
    stored = {}
    for i in range(12):
        meta, blob = make_object(object_id_for(9, 0, i), 3000)
        await store(tier, meta, blob)
        stored[meta.object_id] = blob
    await tier.close()
    KEYRING.save(tmp_path / "disk" / "keyring.json")  # where a daemon keeps it: the probe reads it there
    objects, commits = probe_corruption._records(tmp_path / "disk")
    assert set(objects) == set(stored) and len(commits) >= 1
    rng = random.Random(3)
    for kind in ("record_body", "record_header", "delete_segment"):
        damaged = probe_corruption._damage_disk(kind, tmp_path / "disk", {k: None for k in stored}, rng)
        assert damaged
        reopened = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=64 << 10), keyring=KEYRING)
        await reopened.start()
        try:
            for object_id in list(stored):
                if object_id in damaged:
                    with pytest.raises((NotFound, RejectedState)):
                        await load(reopened, object_id)
                    del stored[object_id]
                else:
                    assert await load(reopened, object_id) == stored[object_id]
        finally:
            await reopened.close()
