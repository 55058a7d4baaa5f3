"""The peer workload's pieces: its raw limit moves exactly the bytes, and the part is planned.

No timing thresholds: the socket raw's receive buffer holds the very bytes sent, and
``statetier bench workloads --only peers`` has its steps in both plans (the whole quick run
is ``test_bench.py``'s).
"""

from __future__ import annotations

import os

from statetier.benchmarks import workloads
from statetier.benchmarks.workload_peers import SocketRaw


def test_the_socket_raw_receives_the_very_bytes_sent() -> None:
    chunks = [os.urandom(n) for n in (1, 4096, 3 << 20)]
    raw = SocketRaw([memoryview(c) for c in chunks])
    raw.run()
    assert bytes(raw.buffer) == b"".join(chunks)


def test_the_peers_part_is_planned_like_the_pd_part() -> None:
    assert "peers" in workloads.PARTS
    for plan in (workloads.QUICK, workloads.FULL):
        assert workloads.steps(plan, "peers") == workloads.steps(plan, "pd")


def test_the_prefix_across_daemons_part_is_planned_like_the_prefix_part() -> None:
    assert "prefix-peers" in workloads.PARTS
    for plan in (workloads.QUICK, workloads.FULL):
        assert workloads.steps(plan, "prefix-peers") == workloads.steps(plan, "prefix")


def test_the_peer_parts_daemons_run_with_the_transport_asked_for() -> None:
    assert workloads.peer_settings("tcp") == {"peers.enabled": "true", "peers.transport": "tcp"}
    assert workloads.peer_settings("nixl")["peers.transport"] == "nixl"


def test_statetier_bench_passes_the_parts_and_the_peer_transport_on_to_workloads() -> None:
    from statetier.benchmarks.cli import parse_args, workload_options

    args = parse_args(["workloads", "--only", "peers", "--peer-transport", "nixl"])
    assert args.suite == ["workloads"]
    assert workload_options(args) == ["--only", "peers", "--peer-transport", "nixl"]
    assert workload_options(parse_args(["workloads"])) == []


def test_the_peer_parts_run_encrypted_when_asked_and_their_rows_say_so() -> None:
    from statetier.benchmarks.cli import parse_args, workload_options
    from statetier.benchmarks.workload_peers import transport_label

    assert "peers.encrypt" not in workloads.peer_settings("tcp")
    settings = workloads.peer_settings("tcp", encrypt=True)
    assert settings["peers.encrypt"] == "true"
    assert transport_label(settings) == "tcp+aes-gcm"
    assert transport_label(workloads.peer_settings("tcp")) == "tcp"
    assert transport_label(workloads.peer_settings("nixl")) == "nixl"
    args = parse_args(["workloads", "--only", "peers", "--peer-encrypt"])
    assert workload_options(args) == ["--only", "peers", "--peer-encrypt"]
