"""What a new operator met in the same hour (issue 35 item 8), one regression test each.

- an unknown ``STATETIER_*`` variable is refused (as an unknown TOML key is), naming the
  setting it is close to; the clients' and tooling's own variables are not settings;
- a start that fails leaves no generated keyring behind; one that succeeds saves it;
- an unbounded Redis tier is described as unbounded, not as "capacity 0 bytes";
- a host arena sized past the machine's available memory is warned about at start;
- ``statetier stats --json`` into a closed pipe exits quietly (141), no ``Broken pipe``;
- a miss on a daemon without Redis says so;
- ``ls`` shows the state ids ``inspect`` takes;
- the connector table in docs/integration.md names each option once.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys

import pytest

from statetier.clients import Client
from statetier.daemon import app as daemon_app
from statetier.daemon.cli import main
from statetier.daemon.config import read_mem_available
from statetier.daemon.config_loading import load_config
from statetier.launch.daemons import DaemonFailed, DaemonProcess
from statetier.protocol.errors import ConfigError, NotFound
from tests.support.daemons import daemon_fixture
from tests.support.deploy_files import REPO
from tests.support.jamba import jamba_namespace, snapshot

SPEC = jamba_namespace("papercuts")
PREFIX = bytes(range(32))


def test_an_unknown_statetier_variable_is_refused_naming_the_close_setting() -> None:
    with pytest.raises(ConfigError, match=r"STATETIER_LOG_LEVL: no such setting \(did you mean STATETIER_LOG_LEVEL\?\)"):
        load_config(env={"STATETIER_LOG_LEVL": "debug"})
    config = load_config(env={"STATETIER_URL": "unix:///x.sock", "STATETIER_TOKEN": "t", "STATETIER_LOG_LEVEL": "debug"})
    assert config.log_level == "debug"


def test_a_start_that_fails_leaves_no_keyring_behind_and_one_that_succeeds_saves_it() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        daemon = DaemonProcess(name="no-keyring", settings={"metrics.port": holder.getsockname()[1]})
        try:
            with pytest.raises(DaemonFailed, match="exited with 2"):
                daemon.start()
            assert not (daemon.disk_dir / "keyring.json").exists()
            daemon.settings = {}
            daemon.start()
            assert (daemon.disk_dir / "keyring.json").exists()
            assert daemon.stop() == 0
        finally:
            daemon.close()


def test_an_unbounded_redis_tier_is_described_as_unbounded(request, fresh_redis) -> None:
    daemon = daemon_fixture(request, name="unbounded", redis_url=fresh_redis.url)
    assert "tier redis: capacity unbounded (redis.capacity_bytes unset" in daemon.log_text()
    assert "capacity 0 bytes" not in daemon.log_text()


def test_a_host_arena_past_the_available_memory_is_warned_about(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="statetier"):
        daemon_app._warn_if_beyond_memory(read_mem_available() // 2)
        assert caplog.records == []
        daemon_app._warn_if_beyond_memory(read_mem_available() + (1 << 30))
    (record,) = caplog.records
    assert "more than this machine's available memory" in record.getMessage()


def test_stats_json_into_a_closed_pipe_exits_quietly(request) -> None:
    daemon = daemon_fixture(request, name="pipe")
    proc = subprocess.Popen([sys.executable, "-m", "statetier.daemon", "stats", "--json", "--url", daemon.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first byte is written (`| head -c0`)
    err = proc.stderr.read()
    assert (proc.wait(timeout=60), err) == (141, b"")


def test_a_miss_on_a_daemon_without_redis_says_it_has_no_redis_tier(request) -> None:
    daemon = daemon_fixture(request, name="no-redis")
    with Client(daemon.url, namespace=SPEC) as client:
        ref = client.put_ssm(1, PREFIX, 64, snapshot(1), request_id="r")
        assert client.delete(ref) >= 1
        with pytest.raises(NotFound, match="it has no Redis tier"):
            client.load(ref)


def test_ls_shows_the_state_ids_inspect_takes(request, capsys) -> None:
    daemon = daemon_fixture(request, name="ids")
    with Client(daemon.url, namespace=SPEC) as client:
        refs = [client.put_ssm(1, PREFIX, 64 * n, snapshot(n), request_id="r") for n in (1, 2, 3, 4)]
        (row,) = client.list_objects()["namespaces"]
    assert row["newest_ids"] == [ref.state_id.hex() for ref in reversed(refs[1:])]
    assert main(["ls", "--url", daemon.url]) == 0
    assert f"{refs[-1].state_id.hex()}" in capsys.readouterr().out
    assert main(["inspect", row["newest_ids"][0], "--url", daemon.url]) == 0


def test_the_connector_table_names_each_option_once() -> None:
    text = (REPO / "docs" / "integration.md").read_text()
    table = text[text.index("| `url` (required) |"):]
    table = table[: table.index("\n\n")]
    options = [name for row in table.splitlines() for name in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert "timeout" in options and len(options) == len(set(options)), options
