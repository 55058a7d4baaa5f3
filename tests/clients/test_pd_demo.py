"""The prefill/decode demo end to end: ``python examples/pd_disaggregation.py`` as a user runs it.

Real processes throughout: the test's ``redis-server``, two ``statetier serve`` daemons,
a prefill worker and a decode worker. Jamba (Mamba-1 mixers, one token per forward after a
restore) and Zamba2 (hybrid layers holding KV and SSM state at once) decode the very
tokens single-process generation produces, with every object served to the decode side
from Redis (the decode daemon never saw the puts) and promoted into its host arena.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
ARCHS = {"jamba": 2, "zamba2": 2}  # objects per request: the KV group object + the SSM group object


def test_decode_side_tokens_equal_single_process_generation(redis_server, tmp_path):
    report = tmp_path / "pd.json"
    command = [sys.executable, str(REPO / "examples" / "pd_disaggregation.py"), "--redis-url", redis_server.url,
               "--json", str(report)]
    for arch in ARCHS:
        command += ["--arch", arch]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "2/2 architectures: decode tokens equal the reference" in done.stdout

    results = {r["arch"]: r for r in json.loads(report.read_text())}
    assert sorted(results) == sorted(ARCHS)
    for arch, objects in ARCHS.items():
        r = results[arch]
        assert r["equal"] and r["tokens"] == r["reference"] and len(r["tokens"]) == 8, r
        assert r["restorable"] == 20 and not r["error"]
        assert r["counters"]["decode"]["hits redis"] == objects
        assert r["counters"]["decode"]["promotions redis->host"] == objects
        assert r["counters"]["prefill"]["bytes redis/store"] > r["state_bytes"]  # payload + sealed headers
        assert "hits redis" not in r["counters"]["prefill"]
        assert r["prefill_ms"] > 0 and r["put_ms"] > 0 and r["lookup_ms"] > 0 and r["load_ms"] > 0
