"""Fixtures shared by the whole suite: real Redis processes on free loopback ports.

- ``redis_server`` (session): one plain ``RedisServer``; tests share it, so they use
  their own keys (or flush what they wrote).
- ``redis_cluster`` (session): a three-master ``RedisCluster``, started on first use.
- ``fresh_redis`` (function): a private ``RedisServer`` that a test may kill or restart.
- ``clock`` (function): a ``ManualClock`` (``tests/support/clock.py``) for a tier's
  ``clock=`` option: its leases expire when the test advances it, not after a sleep.
- ``one_torch_thread`` (module; modules with tiny models name it in ``pytestmark``): torch
  on one thread while the module runs. Tiny models run several times faster on one thread
  than with two fighting over two cores, and one thread keeps every reduction order fixed.

Nothing here touches a Redis on 6379. Every server is closed at teardown, and
``statetier.launch.redis_servers`` kills any survivor at interpreter exit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from statetier.launch.redis_cluster import RedisCluster
from statetier.launch.redis_servers import RedisServer
from tests.support.clock import ManualClock


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    import torch  # only the modules that name this fixture need torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
