"""End to end, real uids: the tenant that owns a namespace is the one its connection
authenticated as, never the one a client writes into its spec — with the daemon up, after a
restart, and on a second daemon sharing the Redis tier.

Tenants are mapped from Unix peer uids (``tenants[].uids``); each worker is a process of
its own uid (``tests/support/tenant_worker.py``: imports, then setgroups/setgid/setuid, then connects).
Tenant A puts a page, durable and published to Redis. Tenant B, whose spec names tenant
"a" (every other field the same as A's), asks for it by key, by A's ref and by lookup:

- daemon up: nothing (``not_found``; A's ref refused as another ``namespace``; 0 tokens);
- after a restart, B asking first: still nothing, and A still finds its page (durable);
- a second daemon on the same Redis and keyring, B asking first: nothing; A finds its page
  there (from Redis).

On the old design a namespace went to the first tenant that used it, in memory: after a
restart (or on another daemon) B, asking first, was given A's namespace and read A's page.

The same through issue 21's entry points: A puts a request's state in group objects as one
batch; B, naming A in its spec, finds nothing of it by a batch of keys (streamed through a
small load window), by a batch of A's refs, by one chosen layer (by key and by ref) or by a
lookup over the groups; once B puts its own under the same keys, each finds only its own,
and after a restart too.

Needs root (to run workers as other uids); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from statetier.launch.daemons import DaemonProcess
from tests.support.keyrings import keyring_file
from tests.support.scripts import REPO, module_command

WORKER = "tests.support.tenant_worker"
UID_A, UID_B, GID_WORKERS = 61201, 61202, 61200

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs workers as other uids: needs root")


def run_worker(job: str, uid: int, **fields) -> dict:
    """One ``tests/support/tenant_worker.py`` job as ``uid`` (group ``GID_WORKERS``); its JSON answer."""
    spec = {"uid": uid, "gid": GID_WORKERS, "groups": [GID_WORKERS], **fields}
    done = subprocess.run(module_command(WORKER, job, json.dumps(spec)), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def place():
    """A directory other uids may traverse (to reach the daemons' sockets), removed after."""
    with keyring_file("st-own-", mode=0o711) as keyring:  # one keyring for both daemons: Redis objects verify on each
        yield keyring.parent, keyring


def daemon_in(directory: Path, keyring: Path, redis_url: str | None, **host) -> DaemonProcess:
    directory.mkdir(mode=0o711)
    directory.chmod(0o711)
    # no "default" tenant: a worker's uid alone says which tenant it is
    config = {"tenants": [{"name": "a", "uids": [UID_A]}, {"name": "b", "uids": [UID_B]}],
              "listen": {"socket_mode": 0o666}, **({"host": host} if host else {})}
    return DaemonProcess(config, redis_url=redis_url, keyring=keyring, directory=directory)


NOTHING = {"by_key": "not_found", "by_ref": "namespace", "by_lookup": "tokens:0"}
EVERYTHING = {"by_key": "bytes", "by_ref": "bytes", "by_lookup": "tokens:16"}


def test_a_tenant_naming_another_in_its_spec_finds_nothing_of_its_up_after_a_restart_and_on_another_daemon(
        place, fresh_redis):
    directory, keyring = place
    spec_of_a = {"model": "owned-ns", "tenant_in_spec": "a"}
    first = daemon_in(directory / "first", keyring, fresh_redis.url)
    second = daemon_in(directory / "second", keyring, fresh_redis.url)
    try:
        first.start()
        put = run_worker("put", UID_A, url=first.url, seed=1, **spec_of_a)
        ref_of_a = put["ref"]

        assert run_worker("find", UID_B, url=first.url, ref=ref_of_a, **spec_of_a) == NOTHING

        first.restart()
        assert run_worker("find", UID_B, url=first.url, ref=ref_of_a, **spec_of_a) == NOTHING  # B first
        assert run_worker("find", UID_A, url=first.url, ref=ref_of_a, **spec_of_a) == EVERYTHING

        second.start()
        assert run_worker("find", UID_B, url=second.url, ref=ref_of_a, **spec_of_a) == NOTHING  # B first
        assert run_worker("find", UID_A, url=second.url, ref=ref_of_a, **spec_of_a) == EVERYTHING
    finally:
        first.close()
        second.close()


GROUPS_OF_NOBODY = {"uses_shm": True, "batch_by_key": "not_found", "load_batch_frames": 1,
                    "layer_by_key": "not_found", "batch_by_ref": "namespace", "layer_by_ref": "namespace",
                    "by_lookup": "tokens:0"}


def groups_of(seed: int, refs: str) -> dict:
    """What ``find_groups`` reports when the finder's own state is seed ``seed``'s, its batch
    by key streamed through the window in three frames (half the window a step, pipelined: issue
    33), and the refs asked for are ``refs``."""
    return {"uses_shm": True, "batch_by_key": f"seed:{seed}", "load_batch_frames": 3, "layer_by_key": f"seed:{seed}",
            "batch_by_ref": refs, "layer_by_ref": refs, "by_lookup": "tokens:64"}


def test_batches_group_objects_and_window_streaming_reach_only_the_tenants_own_namespace(place):
    directory, keyring = place
    spec_of_a = {"model": "owned-groups", "tenant_in_spec": "a"}
    daemon = daemon_in(directory / "groups", keyring, None, window_bytes="2MiB")  # 2.25 MiB of state: 3 half-window steps
    try:
        daemon.start()
        refs_of_a = run_worker("put_groups", UID_A, url=daemon.url, seed=1, **spec_of_a)["refs"]
        assert len(refs_of_a) == 5

        def find(uid: int) -> dict:
            return run_worker("find_groups", uid, url=daemon.url, refs=refs_of_a, seeds=[1, 2], **spec_of_a)

        assert find(UID_B) == GROUPS_OF_NOBODY
        run_worker("put_groups", UID_B, url=daemon.url, seed=2, **spec_of_a)  # the same keys, B's own
        assert find(UID_B) == groups_of(2, refs="namespace")
        assert find(UID_A) == groups_of(1, refs="bytes")

        daemon.restart()  # durable: B asks first, still only its own
        assert find(UID_B) == groups_of(2, refs="namespace")
        assert find(UID_A) == groups_of(1, refs="bytes")
    finally:
        daemon.close()
