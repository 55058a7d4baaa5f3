"""The admin commands against a real daemon: ``ls``, ``lookup``, ``inspect``, ``verify``, ``purge``
(issue 27 items 4, 6 and 8), and what the command line imports.

- ``statetier --help`` and the admin commands import neither torch nor a tier (they used to
  take 4–5 s on a loaded 2-core machine, most of it torch, for a STATS frame).
- ``ls`` shows each namespace with its objects, bytes, copies per tier, kinds and readable
  oldest/newest times; ``inspect`` adds a readable ``created_at``.
- ``lookup`` of a token file under a lookup spec shows, layer by layer, how far each layer
  reaches, and the joint hit; a layer with no state limits the joint hit to 0 and is named.
- ``verify`` reports its progress as it goes (the bar used to stay at 0) and ends at N/N; the
  bar is drawn on a terminal only (issue 41).
- ``stats`` prints hits, misses, rejections by reason and outage-served counts (issue 41).
- ``purge`` without ``--yes`` shows what it would remove and removes nothing; with it, the
  namespace is gone from ``ls`` and its loads are ``NotFound``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from statetier.clients import Client
from statetier.daemon.cli import main
from statetier.protocol.errors import NotFound
from statetier.protocol.identity import prefix_hash
from statetier.protocol.ownership import owned_namespace
from tests.support.daemons import daemon_fixture
from tests.support.jamba import jamba_namespace, kv_page, snapshot, token_ids

REPO = Path(__file__).resolve().parents[2]
SPEC = jamba_namespace("cli-admin", block=16)
TOKENS = token_ids(7, 64)


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, name="cli-admin")


@pytest.fixture(scope="module")
def stored(daemon):
    prefix = prefix_hash(TOKENS, block_size=16)
    with Client(daemon.url, namespace=SPEC) as client:
        refs = [client.put_kv(layer, prefix, 0, 64, kv_page(layer, 64), request_id="cli") for layer in (0, 1)]
        refs += [client.put_ssm(layer, prefix, 64, snapshot(layer), request_id="cli") for layer in (2, 3)]
    return refs


def write_lookup_files(tmp_path: Path, ssm_layers: list[int]) -> tuple[Path, Path]:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(map(str, TOKENS)))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"namespace": dataclasses.asdict(SPEC), "attention_layers": [0, 1],
                                 "ssm_layers": ssm_layers, "kv_layout": "prefix"}))
    return tokens, model


def test_help_and_admin_commands_import_no_torch_and_no_tier() -> None:
    probe = ("import sys\nfrom statetier.daemon.cli import main\n"
             "code = main(['stats', '--url', 'unix:///nonexistent.sock'])\n"
             "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lmdb', 'redis', 'transformers'}),"
             " sorted(m for m in sys.modules if m.startswith('statetier.tiers')))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "2 [] []", done.stdout + done.stderr
    assert "error: unavailable: " in done.stderr


def test_ls_shows_each_namespace_with_readable_sizes_and_times(daemon, stored, capsys) -> None:
    assert main(["ls", "--url", daemon.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["tenant", "namespace", "objects", "copies", "bytes"]
    stored_as = owned_namespace("default", SPEC.namespace()).hex()  # the namespace tenant "default" owns
    row = next(line for line in lines if stored_as in line)
    assert row.split()[:3] == ["default", stored_as, "4"]
    assert int(row.split()[3]) >= 4  # copies: host's, and disk's as write-behind lands them
    assert "host 4" in row and "kv 2, ssm 2" in row and row.count(" UTC (") == 2


def test_inspect_shows_a_readable_creation_time(daemon, stored, capsys) -> None:
    assert main(["inspect", stored[2].state_id.hex(), "--url", daemon.url]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["kind"] == "ssm" and header["layer"] == 2
    assert header["created_at"].endswith("s ago)") and " UTC (" in header["created_at"]


def test_lookup_shows_the_joint_hit_layer_by_layer(daemon, stored, tmp_path, capsys) -> None:
    tokens, model = write_lookup_files(tmp_path, [2, 3])
    assert main(["lookup", "--tokens", str(tokens), "--model", str(model), "--url", daemon.url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"namespace {SPEC.namespace().hex()}: 64 tokens, blocks of 16, kv_layout prefix")
    assert [line.split() for line in out[1:6]] == [["layer", "kind", "restorable", "tokens"], ["0", "attention", "64"],
                                                   ["1", "attention", "64"], ["2", "ssm", "64"], ["3", "ssm", "64"]]
    assert out[6] == "joint hit: 64 of 64 tokens"

    tokens, model = write_lookup_files(tmp_path, [2, 3, 5])  # layer 5 never saved
    assert main(["lookup", "--tokens", str(tokens), "--model", str(model), "--url", daemon.url, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["joint_hit"] == 0
    assert {(item["layer"], item["tokens"]) for item in result["layers"]} == {(0, 64), (1, 64), (2, 64), (3, 64), (5, 0)}


def test_lookup_without_a_namespace_says_how_to_name_one(daemon, tmp_path, capsys) -> None:
    model = tmp_path / "layers.json"
    model.write_text(json.dumps({"attention_layers": [0], "ssm_layers": []}))
    tokens = tmp_path / "t.json"
    tokens.write_text("[1, 2, 3]")
    assert main(["lookup", "--tokens", str(tokens), "--model", str(model), "--url", daemon.url]) == 2
    assert "--namespace HEX" in capsys.readouterr().err


def test_verify_reports_progress_to_the_end(daemon, stored, capsys) -> None:
    with Client(daemon.url, namespace=SPEC) as client:
        seen: list[tuple[int, int]] = []
        report = client.verify(progress=lambda done, total: seen.append((done, total)), poll_seconds=0.001)
    assert seen[-1] == (report["checked"], report["checked"]) and report["checked"] >= 4
    assert all(done <= total for done, total in seen if total)
    assert main(["verify", "--url", daemon.url]) == 0
    captured = capsys.readouterr()
    # copies, not objects: a disk copy the write-behind finished since the first pass is checked too
    assert json.loads(captured.out)["checked"] >= report["checked"]
    assert captured.err == ""  # not a terminal: no progress bar written into it (issue 41)


def test_stats_prints_hits_misses_and_rejections_and_json_carries_them(daemon, stored, capsys) -> None:
    with Client(daemon.url, namespace=SPEC) as client:
        client.load(stored[2])
    assert main(["stats", "--url", daemon.url]) == 0
    out = capsys.readouterr().out
    assert "since start:" in out and "  hits: host ssm 1" in out and "  rejections: " in out
    assert "  served while Redis was unreachable: none" in out
    assert main(["stats", "--url", daemon.url, "--json"]) == 0
    counters = json.loads(capsys.readouterr().out)["counters"]
    assert counters["hits"]["host"]["ssm"] == 1 and set(counters["misses"]) == {"kv", "ssm"}
    assert "bad_signature" in counters["rejections"]


def test_purge_asks_for_yes_then_removes_the_namespace(daemon, stored, capsys) -> None:
    namespace = owned_namespace("default", SPEC.namespace()).hex()  # as `statetier ls` shows it
    assert main(["purge", "--namespace", namespace, "--url", daemon.url]) == 0
    captured = capsys.readouterr()
    assert namespace in captured.out and "nothing was removed" in captured.err
    with Client(daemon.url, namespace=SPEC) as client:
        client.load(stored[0])  # still there
    assert main(["purge", "--namespace", namespace, "--yes", "--url", daemon.url]) == 0
    assert capsys.readouterr().out.startswith("purged 4 objects (")
    with Client(daemon.url, namespace=SPEC) as client:
        for ref in stored:
            with pytest.raises(NotFound):
                client.load(ref)
    assert main(["ls", "--url", daemon.url]) == 0
    assert namespace not in capsys.readouterr().out
