"""The owner-kill probe's wiring (``reliability/probe_owner.py``), without a chaos run: it is
one of ``run.py``'s probes (so ``make chaos`` and ``make chaos-short`` run it), with a share
of the run, and its short form injects each fault once against daemons with the peer tier on."""

from __future__ import annotations

import probe_owner
import run
from harness import Budget


def test_the_probe_runs_in_chaos_and_chaos_short_with_both_faults() -> None:
    assert run.PROBES["owner"] is probe_owner and run.SHARES["owner"] > 0
    assert Budget(60, short=True).scale(40, 1) == 1
    assert set(probe_owner.FAULTS) == {"kill", "sigstop"}
    assert probe_owner.SETTINGS["peers.enabled"] == "true"
    assert probe_owner.HANG_AFTER > probe_owner.PULL_TIMEOUT
