"""Fixtures shared by the whole suite: real Redis processes on free loopback ports.

- ``redis_server`` (session): one plain ``RedisServer``; tests share it, so they use
  their own keys (or flush what they wrote).
- ``redis_cluster`` (session): a three-master ``RedisCluster``, started on first use.
- ``fresh_redis`` (function): a private ``RedisServer`` that a test may kill or restart.

Nothing here touches a Redis on 6379. Every server is closed at teardown, and
``support.redis_procs`` kills any survivor at interpreter exit.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:  # makes ``support`` importable under any import mode
    sys.path.insert(0, _TESTS)

from support.redis_procs import RedisCluster, RedisServer  # noqa: E402


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
