"""Issue 41 (6): the rough edges of the command line, each as a user meets it.

- ``statetier --version`` says the release; ``statetier completion bash`` completes
  subcommands and each one's options in a real bash.
- ``statetier bench --help`` is the benchmark runner's one help: its suites, and a ``--url``
  that defaults to a private daemon, as ``bench workloads --help`` says.
- ``inspect deadbeef`` is "not a state id" before any daemon is asked; no daemon at the
  address is said as such, with how to start one (never an ``Endpoint(...)`` repr).
- ``purge --namespace`` takes a prefix of a namespace as ``ls`` abbreviates it; a prefix
  of two is refused naming both.
- a progress bar is drawn on a terminal only.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from statetier import __version__
from statetier.clients import Client
from statetier.daemon.cli import main
from statetier.daemon.cli.progress import TerminalProgress
from statetier.protocol.ownership import owned_namespace
from tests.support.daemons import daemon_fixture
from tests.support.jamba import jamba_namespace, snapshot

REPO = Path(__file__).resolve().parents[2]
NOWHERE = "unix:///nonexistent/statetier.sock"


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "statetier.daemon", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_version_says_the_release() -> None:
    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"statetier {__version__}"


def complete(script: str, *words: str) -> list[str]:
    """What bash completes after ``words`` (the last one being typed), by the script's own function."""
    function = re.search(r"complete .*-F (\S+) statetier", script).group(1)  # type: ignore[union-attr]
    probe = (f"{script}\nCOMP_WORDS=({' '.join(words)}); COMP_CWORD={len(words) - 1}; COMP_LINE='{' '.join(words)}'; "
             f"COMP_POINT=${{#COMP_LINE}}; {function}\n"
             'printf "%s\\n" "${COMPREPLY[@]}"\n')
    return subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30, check=True).stdout.split()


def test_completion_completes_subcommands_and_their_options_in_bash() -> None:
    done = run_cli("completion", "bash")
    assert done.returncode == 0, done.stderr
    assert complete(done.stdout, "statetier", "pu") == ["purge"]
    assert complete(done.stdout, "statetier", "--ver") == ["--version"]
    assert complete(done.stdout, "statetier", "purge", "--na") == ["--namespace"]
    assert "--json" in complete(done.stdout, "statetier", "stats", "--")
    assert "#compdef statetier" in run_cli("completion", "zsh").stdout


def test_bench_has_one_help_that_lists_its_suites() -> None:
    top, named = run_cli("bench", "--help"), run_cli("bench", "workloads", "--help")
    assert top.returncode == 0 and top.stdout == named.stdout
    for suite in ("seal", "tiers", "sdk", "workloads"):
        assert f"\n  {suite} " in top.stdout
    words = " ".join(top.stdout.split())
    assert "(default: start a private one)" in words and "statetier.sock" not in words


def test_a_malformed_state_id_is_not_an_id_before_any_daemon_is_asked(capsys) -> None:
    assert main(["inspect", "deadbeef", "--url", NOWHERE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid_request: 'deadbeef' is not a state id: one is 32 hex digits")


def test_no_daemon_is_said_with_how_to_start_one(capsys) -> None:
    assert main(["stats", "--url", NOWHERE]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: unavailable: no daemon at {NOWHERE}: start one with `statetier serve` or `make run`")
    assert "Endpoint(" not in err
    assert main(["ls", "--url", "tcp://127.0.0.1:1"]) == 2
    assert "no daemon at tcp://127.0.0.1:1:" in capsys.readouterr().err


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, name="cli-papercuts")


def two_namespaces_sharing_a_first_digit():
    seen: dict[str, object] = {}
    for n in range(64):
        spec = jamba_namespace(f"papercuts-{n}")
        first = owned_namespace("default", spec.namespace()).hex()[0]
        if first in seen:
            return seen[first], spec
        seen[first] = spec
    raise AssertionError("no two namespaces of 64 share a first digit")


def test_purge_takes_a_prefix_as_ls_abbreviates_it_and_refuses_an_ambiguous_one(daemon, capsys) -> None:
    specs = two_namespaces_sharing_a_first_digit()
    for spec in specs:
        with Client(daemon.url, namespace=spec) as client:
            client.put_ssm(1, bytes(32), 64, snapshot(1), request_id="r")
    first, second = (owned_namespace("default", spec.namespace()).hex() for spec in specs)

    assert main(["purge", "--namespace", first[:16] + "…", "--url", daemon.url]) == 0  # dry run: what it would remove
    out = capsys.readouterr().out
    assert first in out and second not in out

    assert main(["purge", "--namespace", first[0], "--yes", "--url", daemon.url]) == 2
    err = capsys.readouterr().err
    assert "is the start of 2 namespaces" in err and first[:16] in err and second[:16] in err

    assert main(["purge", "--namespace", second[:12], "--yes", "--url", daemon.url]) == 0
    assert capsys.readouterr().out.startswith("purged 1 objects")
    assert main(["ls", "--url", daemon.url]) == 0
    listed = capsys.readouterr().out
    assert first in listed and second not in listed


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_on_a_terminal_only() -> None:
    for stream, drawn in ((io.StringIO(), False), (Terminal(), True)):
        progress = TerminalProgress("verify", unit="obj", stream=stream)
        progress(1, 2)
        progress(2, 2)
        progress.close()
        assert bool(stream.getvalue()) is drawn
