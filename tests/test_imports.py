"""The client side stays light: importing it loads no heavy or server-side dependency."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "redis", "lmdb", "prometheus_client", "uvloop")


def test_protocol_and_clients_import_without_heavy_dependencies() -> None:
    probe = (
        "import sys, statetier.protocol, statetier.clients\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_vllm_connector_module_imports_without_vllm_or_torch() -> None:
    """vLLM (and torch) load only when ``StatetierConnector`` is used, so the module imports
    on any machine; the connector's plain logic modules are light too, save the worker's torch."""
    probe = (
        "import sys, statetier.clients.vllm, statetier.clients.vllm_scheduler, statetier.clients.vllm_jobs\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
