"""The README's examples run as written (issue 27 item 5): they are the first thing anyone runs.

The code blocks are read out of README.md, so the README cannot drift from what this runs.

- "Ten lines" against ``make run`` (the Makefile's own target, in a fresh folder; only the
  arena size and the metrics port are the test's, through the Makefile's variables).
- ``make run`` with a bad setting exits non-zero and shows the daemon's own error (it used to
  print "daemon not built yet" and exit 0).
- "Two nodes": the README's shell lines (keygen, the Redis URL, two ``statetier serve``),
  with the Redis URL pointed at a redis-server the test started, then its Python block: the
  decode daemon loads the prefill daemon's published state.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
README_REDIS = "redis://127.0.0.1:6379/0"


def section(title: str) -> list[tuple[str, str]]:
    """The fenced code blocks (language, code) of the README section ``## title``."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```(\w+)\n(.*?)```", text[start:end if end >= 0 else None], re.S)


def make_run(folder: Path, *args: str, prefix: Path = Path(sys.prefix)) -> subprocess.Popen:
    return subprocess.Popen(
        ["make", "-s", "-f", str(REPO / "Makefile"), "-o", f"{prefix}/.installed", "run", f"VENV={prefix}", *args],
        cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_line(proc: subprocess.Popen, marker: str, timeout: float = 60.0) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return "".join(seen)
        assert time.monotonic() < deadline, "".join(seen)
    raise AssertionError(f"the process ended before printing {marker!r}:\n{''.join(seen)}")


def stop_group(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def deepest_below(pid: int) -> int:
    """The deepest process below ``pid``: the daemon that make (this test's) started."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    below, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        below = children + below
        frontier = children
    return below[0]


def run_python(code: str, folder: Path) -> None:
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_ten_lines_run_against_make_run(tmp_path) -> None:
    ((language, code),) = section("Ten lines")
    assert language == "python" and "unix://./statetier.sock" in code
    daemon = make_run(tmp_path, "RUN_HOST_CAPACITY=128MiB", "RUN_ARGS=--metrics-port 0")
    try:
        printed = wait_for_line(daemon, "tier disk:")
        assert f"listening on unix://{tmp_path / 'statetier.sock'}" in printed
        run_python(code, tmp_path)
        os.kill(deepest_below(daemon.pid), signal.SIGTERM)  # the daemon alone: make then exits with its code
        rest, _ = daemon.communicate(timeout=60)
    finally:
        stop_group(daemon)
    assert daemon.returncode == 0 and "statetier: shutting down" in rest
    assert not (tmp_path / "statetier.sock").exists()  # a clean shutdown removes it


def test_make_run_shows_the_daemons_own_error_and_fails(tmp_path) -> None:
    daemon = make_run(tmp_path, "RUN_HOST_CAPACITY=64MiB", "RUN_ARGS=--set limits.byte_budget=0")
    out, _ = daemon.communicate(timeout=120)
    assert daemon.returncode != 0
    assert "error: config: limits.byte_budget: Input should be greater than 0" in out
    assert "not built" not in out
    broken = make_run(tmp_path, prefix=tmp_path / "no-venv")  # a daemon that cannot even start
    out, _ = broken.communicate(timeout=120)
    assert broken.returncode != 0 and f"{tmp_path}/no-venv/bin/statetier" in out, out


def test_the_two_node_example_runs_as_written(tmp_path, fresh_redis) -> None:
    (shell_language, shell), (language, code) = section("Two nodes: prefill and decode")
    assert (shell_language, language) == ("sh", "python")
    statetier = str(Path(sys.prefix) / "bin" / "statetier")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATETIER_")}
    daemons: list[subprocess.Popen] = []
    try:
        for line in shell.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").partition("=")
                assert value == README_REDIS, "the README's Redis URL is the one this test replaces"
                env[name] = fresh_redis.url
                continue
            argv = shlex.split(line.rstrip("&"))
            assert argv[0] == "statetier", line
            if line.endswith("&"):
                daemons.append(subprocess.Popen([statetier, *argv[1:]], cwd=tmp_path, env=env, text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                start_new_session=True))
            else:
                subprocess.run([statetier, *argv[1:]], cwd=tmp_path, env=env, check=True, capture_output=True)
        assert len(daemons) == 2
        for daemon in daemons:
            printed = wait_for_line(daemon, "tier redis:")
            assert "generated a new signing keyring" not in printed  # both read the shared one
        run_python(code, tmp_path)
    finally:
        codes = [stop_group(daemon) for daemon in daemons]
    assert codes == [0, 0]
