"""The peers rows over NIXL (``make test-nixl``): ``python -m statetier.benchmarks.workloads
--only peers --peer-transport nixl`` runs its daemons with ``peers.transport = "nixl"``, every
row says ``transport: nixl`` and decode's loads were served by its peer tier. No timing
thresholds. Skipped unless ``nixl_cu12`` imports.
"""

from __future__ import annotations

import json
import os

import pytest

from statetier.benchmarks import workloads

pytest.importorskip("nixl_cu12._api")


def test_the_peers_rows_run_over_nixl_when_asked(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp"))
    out = tmp_path / "peers.json"
    assert workloads.main(["--quick", "--only", "peers", "--peer-transport", "nixl", "--json", str(out),
                           "--dir", str(tmp_path)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and {row["transport"] for row in rows} == {"nixl"}
    assert all(row["served_by_tier"].get("peer", 0) > 0 for row in rows)
