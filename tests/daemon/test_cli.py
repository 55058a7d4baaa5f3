"""The statetier command line, in process (``main(argv)``) and as ``python -m statetier.daemon``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from statetier.daemon.cli import build_parser, main
from statetier.daemon.cli.formatting import format_stats
from statetier.daemon.cli.serve import config_overrides
from statetier.protocol.keyring import Keyring, SigAlg

REPO = Path(__file__).resolve().parents[2]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_module_help_exits_zero() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "statetier.daemon", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for command in ("serve", "stats", "inspect", "verify", "keygen", "bench"):
        assert command in done.stdout


def test_keygen_writes_a_loadable_keyring_with_mode_0600(tmp_path: Path, capsys) -> None:
    out = tmp_path / "keyring.json"
    assert main(["keygen", "--out", str(out)]) == 0
    assert mode_of(out) == 0o600
    keyring = Keyring.load(out)
    assert keyring.active.alg is SigAlg.HMAC_SHA256 and keyring.active.can_sign
    assert keyring.active.key_id.hex() in capsys.readouterr().out


def test_keygen_refuses_to_overwrite_without_force(tmp_path: Path, capsys) -> None:
    out = tmp_path / "keyring.json"
    assert main(["keygen", "--out", str(out)]) == 0
    first = out.read_bytes()
    capsys.readouterr()

    assert main(["keygen", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"error: config: {out} exists; pass --force to overwrite it\n"
    assert out.read_bytes() == first

    assert main(["keygen", "--out", str(out), "--force"]) == 0
    assert out.read_bytes() != first
    assert mode_of(out) == 0o600


def test_rotate_keeps_the_old_key_for_verification(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    assert main(["keygen", "--out", str(path)]) == 0
    old = Keyring.load(path).active
    signature = old.sign(b"sealed header")

    assert main(["keygen", "--rotate", str(path), "--grace-seconds", "3600"]) == 0
    rotated = Keyring.load(path)
    assert mode_of(path) == 0o600
    assert rotated.active.key_id != old.key_id
    assert rotated.active.alg is SigAlg.HMAC_SHA256
    kept = rotated.get_for_verify(old.key_id)
    assert kept is not None and kept.verify(b"sealed header", signature)
    assert kept.not_after_ns is not None
    assert {k.key_id for k in rotated.keys} == {old.key_id, rotated.active.key_id}


def test_ed25519_keyring_and_trust_store(tmp_path: Path) -> None:
    keyring_path, trust_path = tmp_path / "producer.json", tmp_path / "trust.json"
    assert main(["keygen", "--alg", "ed25519", "--out", str(keyring_path), "--public-out", str(trust_path)]) == 0
    producer = Keyring.load(keyring_path).active
    trust = Keyring.load(trust_path)
    assert producer.alg is SigAlg.ED25519
    [public] = trust.keys
    assert public.key_id == producer.key_id and public.secret is None and public.public == producer.public
    assert public.verify(b"m", producer.sign(b"m"))
    assert mode_of(trust_path) == 0o600


def test_public_out_needs_ed25519(tmp_path: Path, capsys) -> None:
    code = main(["keygen", "--out", str(tmp_path / "k.json"), "--public-out", str(tmp_path / "p.json")])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: config: --public-out needs ed25519 keys")
    assert not (tmp_path / "p.json").exists()


def test_rotate_of_a_missing_file_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert main(["keygen", "--rotate", str(tmp_path / "absent.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: config: key file {tmp_path / 'absent.json'} does not exist")


def test_config_command_prints_the_effective_config(tmp_path: Path, capsys) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[disk]\ndirectory = "/from/file"\nfsync = true\n')
    argv = ["config", "--config", str(toml), "--disk-dir", "/from/flag", "--set", "disk.fsync=false",
            "--metrics-port", "9999", "--host-capacity", "1GiB", "--redis-url", "redis://u:pw@127.0.0.1:1/0"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["disk"]["directory"] == "/from/flag"
    assert printed["disk"]["fsync"] is False
    assert printed["metrics"]["port"] == 9999
    assert printed["host"]["capacity_bytes"] == 1 << 30
    assert printed["redis"]["url"] == "redis://u:***@127.0.0.1:1/0"


def test_serve_flags_become_dotted_overrides() -> None:
    args = build_parser().parse_args(
        ["serve", "--socket", "/run/st.sock", "--tcp", "0.0.0.0:7000", "--no-metrics", "--device", "cuda:1",
         "--log-level", "debug", "--set", "limits.byte_budget=2GiB", "--set", "listen.allowed_uids=[0, 1000]"]
    )
    assert config_overrides(args) == {
        "listen.socket_path": "/run/st.sock",
        "listen.tcp": "0.0.0.0:7000",
        "log_level": "debug",
        "metrics.enabled": False,
        "device.enabled": True,
        "device.device": "cuda:1",
        "limits.byte_budget": "2GiB",
        "listen.allowed_uids": [0, 1000],
    }


def test_config_errors_exit_2_naming_the_field(capsys) -> None:
    assert main(["config", "--set", "limits.byte_budget=0"]) == 2
    assert capsys.readouterr().err == (
        "error: config: limits.byte_budget: Input should be greater than 0 (from override limits.byte_budget)\n"
    )
    assert main(["serve", "--tcp", "no-port"]) == 2  # fails validation before the daemon is imported
    assert "listen.tcp: expected \"host:port\"" in capsys.readouterr().err


def test_inspect_rejects_a_non_hex_id_before_connecting(capsys) -> None:
    assert main(["inspect", "not-hex", "--url", "unix:///nonexistent.sock"]) == 2
    assert capsys.readouterr().err.startswith("error: invalid_request: 'not-hex' is not a state id: one is 32 hex")


def test_stats_table() -> None:
    table = format_stats({
        "tiers": [
            {"tier": "host", "objects": 3, "bytes_used": 3 << 20, "capacity": 12 << 20, "leases": 1, "inflight": 0,
             "evictions": 2, "compactions_run": 0},
            {"tier": "disk", "objects": 10, "bytes_used": 0, "capacity": 0, "leases": 0, "inflight": 0,
             "evictions": 0, "compactions_run": 5},
        ],
        "daemon": {"connections": 2, "budget_bytes_in_use": 0},
        "leases": 1,
        "tenants": {},
    })
    assert table.splitlines() == [
        "tier  copies     used  capacity    use  leases  inflight  evictions  compactions",
        "host       3  3.0 MiB  12.0 MiB  25.0%       1         0          2            0",
        "disk      10      0 B       0 B      -       0         0          0            5",
        "(copies per tier: an object in two tiers counts in both; statetier ls counts each object once)",
        "daemon:",
        "  budget_bytes_in_use: 0",
        "  connections: 2",
        "leases: 1",
        "tenants: {}",
    ]


def test_no_command_prints_help_and_fails(capsys) -> None:
    assert main([]) == 2
    assert "usage: statetier" in capsys.readouterr().out


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_output_is_a_config_error(tmp_path: Path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(["keygen", "--out", str(locked / "k.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: config: cannot write {locked / 'k.json'}")


def sync_client_or_skip() -> None:
    try:
        from statetier.clients import Client  # noqa: F401
    except ImportError:
        pytest.skip("the sync client (statetier.clients.Client) is not there yet")


@pytest.mark.timeout(120)
def test_client_commands_against_a_running_daemon(tmp_path: Path, capsys) -> None:
    sync_client_or_skip()
    sock = tmp_path / "st.sock"
    url = f"unix://{sock}"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "statetier.daemon", "serve", "--socket", str(sock), "--disk-dir", str(tmp_path / "data"),
         "--no-metrics", "--set", "host.enabled=false", "--set", "disk.fsync=false", "--set", "disk.capacity_bytes=64MiB"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    seen: list[str] = []
    try:
        for line in daemon.stdout:  # the app prints where it listens once it serves
            seen.append(line)
            if "listening on" in line:
                break
        assert seen and str(sock) in seen[-1], "".join(seen)
        capsys.readouterr()

        assert main(["stats", "--json", "--url", url]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert [tier["tier"] for tier in stats["tiers"]] == ["disk"]

        assert main(["stats", "--url", url]) == 0
        assert capsys.readouterr().out.splitlines()[0].split()[:3] == ["tier", "copies", "used"]

        assert main(["verify", "--url", url]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["checked"], report["dropped"]) == (0, 0)

        assert main(["inspect", "00" * 16, "--url", url]) == 2
        assert capsys.readouterr().err.startswith("error: not_found: ")
    finally:
        daemon.terminate()
        rest, _ = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, "".join(seen) + rest


def test_client_commands_report_an_absent_daemon(tmp_path: Path, capsys) -> None:
    sync_client_or_skip()
    assert main(["stats", "--url", f"unix://{tmp_path}/absent.sock"]) == 2
    assert capsys.readouterr().err.startswith("error: unavailable: ")
