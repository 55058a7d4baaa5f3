"""``statetier bench``: the whole quick run end to end, and its parts. No timing thresholds.

The end-to-end test runs ``python -m statetier.daemon bench --quick --json FILE`` as a
subprocess (the seal and tier suites as ``python -m statetier.benchmarks.<suite>``, then the SDK benchmark against its
own daemon) and checks the JSON other tools read: every row has the documented fields,
``ratio == gbps / raw_gbps``, and the SDK suite measured exactly the planned rows.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from statetier.benchmarks.cli import main, parse_args, run_module_suite
from statetier.benchmarks.rows import RESULT_FIELDS, seal_rows, tier_rows
from statetier.benchmarks.sdk import QUICK, TARGETS, THROUGHPUT_TARGET
from statetier.daemon.client_env import DEFAULT_CLIENT_URL

REPO = Path(__file__).resolve().parents[2]
MACHINE_FIELDS = ("cpu_model", "cpus", "cpus_usable", "memory_bytes", "kernel", "platform", "python", "torch",
                  "uvloop", "blake3", "load_average_before", "load_average_after")


def planned_sdk_rows() -> set[tuple]:
    rows = {(path, op, size, batch) for size, batches in QUICK.batches.items() for batch in batches
            for path in ("shm", "inline") for op in ("put", "load", "load_into")}
    return rows | {("unix", "lookup", None, 1), ("unix", "ping", None, 1), ("unix", "lookup48x16", None, 1),
                   ("unix", "lookup_jamba_groups", None, 1)}


def check_row(row: dict) -> None:
    for name in RESULT_FIELDS:
        assert name in row, (name, row)
    assert all(isinstance(row[name], str) and row[name] for name in ("suite", "tier", "op", "raw")), row
    assert isinstance(row["size_bytes"], int) and row["size_bytes"] > 0, row
    assert isinstance(row["batch"], int) and row["batch"] >= 1, row
    for name in ("gbps", "raw_gbps", "ratio", "p50_us"):
        assert isinstance(row[name], float) and math.isfinite(row[name]) and row[name] > 0, (name, row)
    assert row["ratio"] == pytest.approx(row["gbps"] / row["raw_gbps"], rel=1e-12), row
    if row["p99_us"] is not None:
        assert row["p99_us"] >= row["p50_us"], row


@pytest.mark.timeout(900)
def test_quick_bench_writes_one_json_object_with_every_suite(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "statetier.daemon", "bench", "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "== summary" in done.stdout

    document = json.loads(out.read_text())
    assert set(document) >= {"results", "machine", "suites", "options", "seconds"}
    for name in MACHINE_FIELDS:
        assert document["machine"].get(name) is not None, name
    assert len(document["machine"]["load_average_before"]) == len(document["machine"]["load_average_after"]) == 3
    assert {name: info["status"] for name, info in document["suites"].items()} == {
        "seal": "ok", "tiers": "ok", "sdk": "ok"}

    rows = document["results"]
    for row in rows:
        check_row(row)
    by_suite = {suite: [row for row in rows if row["suite"] == suite] for suite in ("seal", "tiers", "sdk")}
    assert len(rows) == sum(len(found) for found in by_suite.values())
    assert {row["op"] for row in by_suite["seal"]} == {"seal", "open"}
    assert by_suite["tiers"] and {row["op"] for row in by_suite["tiers"]} <= {"store", "load", "serve"}
    measured = {(row["tier"], row["op"], row["size_bytes"] if row["metric"] == "throughput" else None, row["batch"])
                for row in by_suite["sdk"]}
    assert measured == planned_sdk_rows()
    throughput = [row for row in by_suite["sdk"] if row["metric"] == "throughput"]
    assert all(row["target"] == TARGETS.get((row["op"], row["size_bytes"], row["batch"]), THROUGHPUT_TARGET)
               for row in throughput)
    assert {row["op"]: row["target"] for row in by_suite["sdk"] if row["metric"] == "latency"} == {
        "lookup": pytest.approx(1 / 3), "ping": pytest.approx(1 / 1.5), "lookup48x16": 1.0, "lookup_jamba_groups": 1.0}
    # every put and load of the shared-memory path, broken down by measured phase; a batch's
    # phase line also says the daemon's time per object
    traced = {(row["op"], row["size_bytes"], row["batch"]) for row in throughput if row.get("phases_us")}
    assert traced == {(op, size, batch) for size, batches in QUICK.batches.items() for batch in batches
                      for op in ("put", "load", "load_into")}
    for row in throughput:  # each also against the two-thread ceiling of the same run
        assert row["ratio_2t"] == pytest.approx(row["raw_2t_p50_us"] / row["p50_us"], rel=1e-9), row
        if row.get("phases_us"):
            assert {"round_trip", "daemon", "frames", "client_copy"} <= set(row["phases_us"]), row
            assert ("daemon_per_item" in row["phases_us"]) == (row["batch"] > 1), row
            assert len(row["load_average"]) == 3


def test_a_suite_that_fails_is_reported_not_fatal(tmp_path: Path, capsys) -> None:
    info = run_module_suite("no_such_suite", quick=True, workdir=tmp_path, tmp_dir=None)
    assert (info["status"], info["rows"]) == ("failed", []) and info["returncode"] != 0
    assert "no_such_suite: FAILED" in capsys.readouterr().out


def test_an_unreachable_daemon_fails_the_sdk_suite_and_the_exit_status(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["--url", f"unix://{tmp_path}/nobody.sock", "--json", str(out), "sdk"]) == 1
    document = json.loads(out.read_text())
    assert document["suites"]["sdk"]["status"] == "failed" and document["results"] == []
    assert document["suites"]["sdk"]["error"].startswith("Unavailable: ")


def test_the_cli_default_url_means_a_private_daemon_and_suites_pass_through() -> None:
    args = parse_args(["--url", DEFAULT_CLIENT_URL, "--quick", "--", "sdk", "seal"])
    assert (args.url, args.quick, args.suite) == (None, True, ["sdk", "seal"])
    args = parse_args(["--url", "unix:///run/statetier/d.sock", "--json", "out.json"])
    assert (args.url, args.json, args.suite) == ("unix:///run/statetier/d.sock", "out.json", [])
    with pytest.raises(SystemExit):
        parse_args(["--url", DEFAULT_CLIENT_URL, "nonsense"])


def test_suite_rows_get_ratio_as_gbps_over_raw_and_keep_the_paired_ratio() -> None:
    seal = {"results": [{"case": "1 tensor 2MiB", "digest": "blake3", "payload_bytes": 2 << 20, "tensors": 1,
                         "copy_gbps": 19.0, "raw_gbps": 10.0, "seal_gbps": 8.0, "open_gbps": 5.0, "seal_ratio": 0.81,
                         "open_ratio": 0.52, "seal_overhead_us": 50.0, "open_overhead_us": 200.0}]}
    rows = seal_rows(seal)
    assert [(r["op"], r["gbps"], r["raw_gbps"], r["ratio"], r["ratio_paired"]) for r in rows] == [
        ("seal", 8.0, 10.0, 0.8, 0.81), ("open", 5.0, 10.0, 0.5, 0.52)]
    assert rows[0]["p50_us"] == pytest.approx((2 << 20) / 8.0 / 1e3) and rows[0]["p99_us"] is None

    tiers = {"rows": [{"suite": "tiers", "tier": "disk", "op": "store", "size_bytes": 1 << 20, "batch": 1,
                       "gbps": 3.0, "raw": "write+fdatasync", "raw_gbps": 4.0, "ratio": 0.77, "p50_us": 350.0,
                       "p99_us": 400.0, "target": 0.75}]}
    (row,) = tier_rows(tiers)
    assert (row["ratio"], row["ratio_paired"], row["target"]) == (0.75, 0.77, 0.75)
