"""Fixtures of the fault suite: the PD pipeline's processes.

- ``pd_nodes`` (module) → ``PDNodes``: two ``statetier serve`` subprocesses
  (``tests/support/daemons.py``), ``prefill`` and ``decode``, each with its own socket,
  disk dir and metrics port, both on the session ``redis_server`` and one signing keyring
  (``keyring``); ``redis`` is a redis-py client on that server, for the tests that damage
  stored bytes. Teardown stops both daemons and asserts they exited cleanly.
- ``plain_redis`` (module): a redis-py client on the session ``redis_server`` for the
  plain SET/GET contrast; it deletes its ``plain:*`` keys at teardown.
- torch on one thread: each module names ``one_torch_thread`` (tests/conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("transformers")

from statetier.launch.daemons import DaemonProcess  # noqa: E402
from statetier.protocol.keyring import Keyring  # noqa: E402
from tests.support.daemons import daemon_fixture  # noqa: E402
from tests.support.keyrings import keyring_file  # noqa: E402


@dataclass
class PDNodes:
    prefill: DaemonProcess
    decode: DaemonProcess
    keyring: Keyring
    redis: object


@pytest.fixture(scope="module")
def pd_nodes(request, redis_server):
    with keyring_file(prefix="st-faults-") as path:
        settings = {"keys.keyring_file": path, "disk.fsync": "false"}
        prefill = daemon_fixture(request, name="prefill", redis_url=redis_server.url, settings=settings)
        decode = daemon_fixture(request, name="decode", redis_url=redis_server.url, settings=settings)
        client = redis_server.client()
        yield PDNodes(prefill, decode, Keyring.load(path), client)
        client.close()


@pytest.fixture(scope="module")
def plain_redis(redis_server):
    client = redis_server.client()
    yield client
    keys = list(client.scan_iter(match="plain:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
