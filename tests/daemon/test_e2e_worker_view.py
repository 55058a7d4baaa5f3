"""End to end, real uids: what a worker of another tenant, in the daemon's group, can open or
map on the host holds none of a tenant's bytes — while that tenant's connection is open and
after it closes.

A deployment runs the daemon under its own service group and adds each worker to that group
so it can reach the 0660 socket (docs/operations.md). Here the daemon runs with gid
``GID_DAEMON`` in a directory of that group (mode 0750, as a state directory a worker may
enter), tenant A and tenant B are workers of their own uids with ``GID_DAEMON`` as a
supplementary group (``tests/support/tenant_worker.py``: fork + setuid). A puts a page (durable, so it
reaches the disk tier too) and loads it back; B then searches, as its own uid, every file
under the daemon's directory and in ``/dev/shm`` it can open, every descriptor in
``/proc/<pid>/fd`` and every mapping in ``/proc/<pid>/mem`` of the daemon and of A that it
can read, for 64 bytes of A's page: none, while A is connected and after A is gone.

On the old design B found them twice: in the host arena, a named ``/dev/shm`` file created
0660 in the daemon's group, and in the disk tier's segment files (0640, directories 0750).
Needs root (to run processes as other uids); skipped otherwise.

And a daemon's arena is a memfd: nothing of it is in ``/dev/shm`` while it runs, or after it
is killed with SIGKILL (the old named arena file stayed behind until someone removed it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from statetier.clients import Client
from statetier.launch.daemons import DaemonProcess
from statetier.protocol.identity import NamespaceSpec
from tests.support.folders import short_folder
from tests.support.scripts import REPO, module_command

WORKER = "tests.support.tenant_worker"
UID_A, UID_B = 61301, 61302
GID_A, GID_B, GID_DAEMON = 61301, 61302, 61300

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs processes as other uids: needs root")


def worker_argv(job: str, uid: int, gid: int, **fields) -> list[str]:
    spec = {"uid": uid, "gid": gid, "groups": [gid, GID_DAEMON], **fields}
    return module_command(WORKER, job, json.dumps(spec))


def scan_as_b(probe: str, daemon: DaemonProcess, *pids: int) -> dict:
    done = subprocess.run(worker_argv("scan", UID_B, GID_B, probe=probe, roots=[str(daemon.directory)],
                                      pids=list(pids)), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def daemon():
    if os.geteuid() != 0:
        pytest.skip("runs processes as other uids: needs root")
    with short_folder("st-view-", mode=0o750) as directory:  # the daemon's group may enter (the socket is here)
        os.chown(directory, 0, GID_DAEMON)
        config = {"tenants": [{"name": "a", "uids": [UID_A]}, {"name": "b", "uids": [UID_B]}]}
        process = DaemonProcess(config, directory=directory, group=GID_DAEMON)
        process.start()
        yield process
        process.close()


@needs_root
def test_a_worker_of_another_tenant_in_the_daemons_group_finds_none_of_a_tenants_bytes(daemon):
    a = subprocess.Popen(worker_argv("put", UID_A, GID_A, url=daemon.url, model="view", tenant_in_spec="",
                                     seed=5, hold_seconds=120), cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        put = json.loads(a.stdout.readline())
        assert put["uses_shm"]  # A went through its shared-memory windows
        assert json.loads(a.stdout.readline()) == {"holding": True}

        while_connected = scan_as_b(put["probe"], daemon, daemon.pid, a.pid)
        a.send_signal(signal.SIGKILL)
        a.wait()
        after = scan_as_b(put["probe"], daemon, daemon.pid)
    finally:
        a.kill()
        a.wait()

    assert while_connected["found"] == [] and after["found"] == []
    assert while_connected["opened"] >= 2 and after["opened"] >= 2  # B did open things: the log, the config
    assert (while_connected["memory_read"], after["memory_read"]) == (0, 0)  # no other uid's memory
    assert sorted(p.name for p in daemon.directory.iterdir()) == ["config.toml", "d.sock", "daemon.log", "disk"]


def arena_files_of(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"statetier-host-{pid}-")]


def test_the_daemons_arena_is_a_memfd_and_a_sigkill_leaves_nothing_in_dev_shm(tmp_path):
    with DaemonProcess(name="memfd") as daemon:
        with Client(daemon.url, namespace=NamespaceSpec(model_id="memfd")) as client:
            client.put_kv(0, bytes(32), 0, 16, {"kv": torch.ones(16, 1024)}, request_id="r")
        maps = Path(f"/proc/{daemon.pid}/maps").read_text()
        assert "/memfd:statetier-host" in maps and "/dev/shm/statetier" not in maps
        assert arena_files_of(daemon.pid) == []
        pid = daemon.pid
        daemon.kill()
        assert arena_files_of(pid) == []
