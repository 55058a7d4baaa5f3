"""The Redis fixtures start real servers that tests can use, crash and bring back."""

from __future__ import annotations

import os

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.cluster import RedisCluster as ClusterClient
from redis.retry import Retry

from statetier.launch import redis_cluster
from statetier.launch.processes import free_port
from statetier.launch.redis_binaries import find_redis_binaries
from statetier.launch.redis_cluster import RedisCluster
from statetier.launch.redis_servers import RedisServer


def test_session_server_serves_set_and_get(redis_server: RedisServer) -> None:
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redis_server.port != 6379
    with redis.Redis.from_url(redis_server.url) as client:
        client.set("fixtures:hello", b"world")
        assert client.get("fixtures:hello") == b"world"
        client.delete("fixtures:hello")


def test_kill_then_restart_comes_back_on_the_same_port_empty(fresh_redis: RedisServer) -> None:
    port, old_pid = fresh_redis.port, fresh_redis.pid
    with fresh_redis.client() as client:
        client.set("k", b"v")
    fresh_redis.kill()
    assert not fresh_redis.is_running
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)
    with fresh_redis.client(retry=Retry(NoBackoff(), 0)) as client, pytest.raises(redis.ConnectionError):
        client.ping()

    fresh_redis.restart()
    assert fresh_redis.port == port
    assert fresh_redis.pid != old_pid
    with fresh_redis.client() as client:
        assert client.get("k") is None  # no persistence: a crash loses everything
        client.set("k", b"v2")
        assert client.get("k") == b"v2"


def test_restart_with_appendonly_keeps_data(fresh_redis: RedisServer) -> None:
    fresh_redis.stop()
    fresh_redis.start(fresh_redis.port, ["--appendonly", "yes", "--appendfsync", "always"])
    with fresh_redis.client() as client:
        client.set("durable", b"yes")
    fresh_redis.kill()
    fresh_redis.restart()
    with fresh_redis.client() as client:
        assert client.get("durable") == b"yes"


def test_stop_terminates_the_process() -> None:
    server = RedisServer().start()
    try:
        pid = server.pid
        server.stop()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        server.stop()  # idempotent
    finally:
        server.close()
    assert not server.is_running


def test_requirepass_and_acl_users() -> None:
    server = RedisServer(password="s3cret", acl_users=["alice on >wonder ~app:* +@all"])
    with server:
        assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
        with redis.Redis(host="127.0.0.1", port=server.port, retry=Retry(NoBackoff(), 0)) as anonymous:
            with pytest.raises(redis.AuthenticationError):
                anonymous.ping()
        with redis.Redis.from_url(server.url) as default_user:
            assert default_user.ping() is True
        with server.client(username="alice", password="wonder") as alice:
            alice.set("app:x", b"1")
            with pytest.raises(redis.exceptions.NoPermissionError):
                alice.set("other:x", b"1")


def test_a_taken_port_is_a_clear_error(redis_server: RedisServer) -> None:
    server = RedisServer(start_timeout_s=5)
    with pytest.raises(RuntimeError, match="taken"):
        server.start(redis_server.port)
    assert not server.is_running
    with pytest.raises(RuntimeError, match="not started"):
        _ = server.dir  # the failed start left no temp dir behind


def test_failed_start_shows_the_log_tail() -> None:
    server = RedisServer()
    try:
        with pytest.raises(RuntimeError, match="exited") as info:
            server.start(free_port(), ["--no-such-option", "1"])
        assert "no-such-option" in str(info.value)
    finally:
        server.close()


def test_binaries_are_found() -> None:
    server_bin, _cli = find_redis_binaries()
    assert os.access(server_bin, os.X_OK)


def test_cluster_serves_keys_in_every_slot_range(redis_cluster: RedisCluster) -> None:
    nodes = [ClusterNode(host, port) for host, port in redis_cluster.startup_nodes]
    assert len(nodes) == 3
    assert redis_cluster.url == f"redis://127.0.0.1:{nodes[0].port}"
    client = ClusterClient(startup_nodes=nodes)
    try:
        keys = ["a", "b", "c", "d", "e", "f", "g", "h"]
        owners = {client.get_node_from_key(key).port for key in keys}
        assert owners == {node.port for node in nodes}  # the keys span all three masters
        for key in keys:
            client.set(key, key.encode() * 3)
        assert [client.get(key) for key in keys] == [key.encode() * 3 for key in keys]
        assert client.cluster_info()["cluster_state"] == "ok"
    finally:
        client.close()


def test_cluster_without_a_cli_is_built_with_cluster_commands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server_bin, _cli = find_redis_binaries()
    monkeypatch.setattr(redis_cluster, "find_redis_binaries", lambda: (server_bin, None))
    cluster = RedisCluster().start()
    try:
        pids = [node.pid for node in cluster.nodes]
        client = ClusterClient(startup_nodes=[ClusterNode(h, p) for h, p in cluster.startup_nodes])
        try:
            for key in ("a", "b", "c"):  # one key on each master
                client.set(key, key.encode())
            assert [client.get(key) for key in ("a", "b", "c")] == [b"a", b"b", b"c"]
        finally:
            client.close()
        cluster.stop()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        cluster.close()
