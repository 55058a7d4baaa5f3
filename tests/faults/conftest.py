"""Fixtures of the fault suite: the PD pipeline's processes.

- ``pd_nodes`` (module) → ``PDNodes``: two ``statetier serve`` subprocesses
  (``tests/daemon/daemon_procs.py``), ``prefill`` and ``decode``, each with its own socket,
  disk dir and metrics port, both on the session ``redis_server`` and one signing keyring
  (``keyring``); ``redis`` is a redis-py client on that server, for the tests that damage
  stored bytes. Teardown stops both daemons and asserts they exited cleanly.
- ``plain_redis`` (module): a redis-py client on the session ``redis_server`` for the
  plain SET/GET contrast; it deletes its ``plain:*`` keys at teardown.
- torch on one thread: each module names ``one_torch_thread`` (tests/conftest.py).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")

if str(Path(__file__).parent) not in sys.path:  # the sibling fault_harness, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))

import fault_harness  # noqa: E402,F401  (puts examples/ and tests/daemon/ on sys.path)
from daemon_procs import daemon_fixture  # noqa: E402
from statetier.launch.daemons import DaemonProcess  # noqa: E402
from statetier.protocol.keyring import Keyring  # noqa: E402


@dataclass
class PDNodes:
    prefill: DaemonProcess
    decode: DaemonProcess
    keyring: Keyring
    redis: object


@pytest.fixture(scope="module")
def pd_nodes(request, redis_server):
    directory = Path(tempfile.mkdtemp(prefix="st-faults-", dir="/tmp"))
    keyring = Keyring.generate()
    keyring.save(directory / "keyring.json")
    settings = {"keys.keyring_file": directory / "keyring.json", "disk.fsync": "false"}
    prefill = daemon_fixture(request, name="prefill", redis_url=redis_server.url, settings=settings)
    decode = daemon_fixture(request, name="decode", redis_url=redis_server.url, settings=settings)
    client = redis_server.client()
    yield PDNodes(prefill, decode, keyring, client)
    client.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def plain_redis(redis_server):
    client = redis_server.client()
    yield client
    keys = list(client.scan_iter(match="plain:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
