"""End to end: a configuration mistake never destroys what is stored (issue 27, items 1–2).

- Two daemons given one disk directory: the second refuses to start with exit 2 and
  ``disk.directory … is in use by pid <first>``, leaves no socket behind, and every put the
  first acknowledged as durable loads back after the first restarts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling daemon_procs.py

from daemon_procs import assert_same_tensors, jamba_namespace, snapshot  # noqa: E402
from statetier.clients import Client  # noqa: E402
from statetier.launch.daemons import DaemonFailed, DaemonProcess  # noqa: E402

SPEC = jamba_namespace("misconfiguration")


def test_a_second_daemon_on_a_disk_directory_in_use_refuses_to_start_naming_the_first(tmp_path) -> None:
    shared = tmp_path / "shared-disk"
    first = DaemonProcess(name="first", settings={"disk.directory": shared})
    second = DaemonProcess(name="second", settings={"disk.directory": shared})
    try:
        first.start()
        with Client(first.url, namespace=SPEC) as client:
            refs = [client.put_ssm(layer, bytes(32), 64, snapshot(layer), request_id="r", durable=True)
                    for layer in range(10)]
        assert all(ref.durable for ref in refs)
        with pytest.raises(DaemonFailed, match="exited with 2"):
            second.start()
        assert f"disk.directory {shared} is in use by pid {first.pid}" in second.log_text()
        assert not second.socket_path.exists()
        first.restart()
        with Client(first.url, namespace=SPEC) as client:
            for layer, ref in enumerate(refs):
                assert_same_tensors(client.load(ref), snapshot(layer))
    finally:
        second.close()
        first.close()
