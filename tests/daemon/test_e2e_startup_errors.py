"""End to end: what an operator reads when a setting is wrong (issue 27 items 6 and 7).

- A metrics port already in use: the daemon exits 2 naming ``metrics.port`` and how to fix it,
  and leaves no socket file behind (it used to print ``unavailable: [Errno 98] …`` and leave
  the socket it had bound).
- An object over the frame limit, sent inline: ``FrameTooLarge`` names
  ``limits.max_frame_bytes`` and ``host.window_bytes``.
- ``statetier.toml`` in the current folder is read, and said so on stderr.
"""

from __future__ import annotations

import socket

import pytest

from statetier.clients import Client
from statetier.daemon.cli import main
from statetier.launch.daemons import DaemonFailed, DaemonProcess
from statetier.protocol.errors import FrameTooLarge
from tests.support.daemons import daemon_fixture
from tests.support.jamba import jamba_namespace, kv_page


def test_a_metrics_port_in_use_names_the_setting_and_leaves_no_socket_behind() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        daemon = DaemonProcess(name="port-taken", settings={"metrics.port": port})
        try:
            with pytest.raises(DaemonFailed, match="exited with 2"):
                daemon.start()
            assert f"error: config: metrics.port: 127.0.0.1:{port} is in use" in daemon.log_text()
            assert "--metrics-port; 0 picks a free one" in daemon.log_text()
            assert not daemon.socket_path.exists()
        finally:
            daemon.close()


def test_an_object_over_the_frame_limit_names_the_settings(request) -> None:
    daemon = daemon_fixture(request, name="frame-limit", settings={"limits.max_frame_bytes": "1MiB"})
    with Client(daemon.url, namespace=jamba_namespace("frame-limit"), use_shm=False) as client:
        with pytest.raises(FrameTooLarge) as refused:
            client.put_kv(0, bytes(32), 0, 512, kv_page(0, 512), request_id="big")  # 2 MiB inline
        assert "limits.max_frame_bytes" in refused.value.message and "host.window_bytes" in refused.value.message
        client.put_kv(0, bytes(32), 0, 16, kv_page(0, 16), request_id="small")  # the connection still serves


def test_a_statetier_toml_in_the_current_folder_is_read_and_said_so(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("STATETIER_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["config"]) == 0
    assert capsys.readouterr().err == ""
    (tmp_path / "statetier.toml").write_text('[disk]\ndirectory = "/from/the/local/file"\n')
    assert main(["config"]) == 0
    captured = capsys.readouterr()
    assert '"directory": "/from/the/local/file"' in captured.out
    assert captured.err.startswith(f"statetier: reading {tmp_path / 'statetier.toml'} (found in the current folder")
    other = tmp_path / "other.toml"
    other.write_text('[disk]\ndirectory = "/from/the/named/file"\n')
    assert main(["config", "--config", str(other)]) == 0
    captured = capsys.readouterr()
    assert '"directory": "/from/the/named/file"' in captured.out and captured.err == ""
