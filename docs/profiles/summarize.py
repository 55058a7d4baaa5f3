"""Summarize a ``py-spy record --format raw`` file: CPU per request by function, top N.

``python docs/profiles/summarize.py RAW COUNT_LINE NOTE`` — COUNT_LINE is what ``drive.py``
printed ("OP: N requests in S s ..."); the recording covered S - 1 s of it at 250 Hz. Prints
the samples, the CPU µs per request (samples of a thread waiting in epoll, a sleep or
the executor's queue left out), and the top functions by self time (the frame that was
running) and by inclusive time (anywhere on the stack), each in µs of CPU per request.
"""

from __future__ import annotations

import collections
import re
import sys

RATE = 250
TOP = 25
# where a frame's own time goes, by the file (or native symbol) it names: first match wins
PHASES = (
    ("socket syscalls", ("write (libc", "writev (libc", "read (libc", "sendmsg", "recvmsg", "recv (libc")),
    ("collector", ("gc_collect",)),
    ("frame codec", ("(frames.py)", "(wire_meta.py)", "_core.cpython", "mpack_")),
    ("request path (connection, runner, handlers, transport)",
     ("(connection.py)", "(request_task.py)", "(eager.py)", "(handlers.py)", "(load_handlers.py)",
      "(put_handlers.py)", "(frame_writer.py)", "(transport.py)", "(async_client.py)", "(replies.py)",
      "(dispatch.py)", "(budget.py)", "(windows.py)", "(shm.py)")),
    ("value objects built (dataclass __init__ / __post_init__)", ("__create_fn__", "__post_init__")),
    ("metrics", ("(metrics.py)", "(values.py)", "(samples.py)", "MutexValue")),
    ("digests and copies", ("blake3", "blake2", "(copies.py)", "(tensors.py)", "memcpy", "memmove",
                            "(sealed.py)", "(sealed_format.py)", "(digests.py)", "hmac", "sha256")),
    ("engine and tiers", ("(puts.py)", "(loads.py)", "(serving.py)", "(placement.py)", "(lookup.py)",
                          "(fencing.py)", "(handoff.py)", "(tenancy.py)", "(leases.py)", "(engine.py)",
                          "(registry.py)", "(ledger.py)", "(extent.py)", "(extents.py)", "(stores.py)",
                          "(removal.py)", "(identity.py)", "(ownership.py)", "(expectation.py)",
                          "(classify.py)", "(lru.py)", "(candidates.py)", "(stack.py)", "(transfers.py)")),
)
# py-spy --native counts threads blocked in these as busy: a sample waiting there is idle
WAITS = ("epoll_pwait", "epoll_wait", "clock_nanosleep", "_queue_SimpleQueue_get", "select (")


def frame_name(frame: str) -> str:
    """``function (path/file.py:123)`` → ``function (file.py)``: lines apart, one function."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame
    name, where = match.groups()
    return f"{name} ({where.rsplit('/', 1)[-1]})"


def main(raw: str, count_line: str, note: str) -> None:
    match = re.search(r"(\d+) requests in ([\d.]+) s", count_line)
    requests, seconds = int(match.group(1)), float(match.group(2))
    recorded = requests * (seconds - 1) / seconds
    own, anywhere, total, waiting = collections.Counter(), collections.Counter(), 0, 0
    with open(raw) as handle:
        lines = handle.read().splitlines()
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        n = int(n)
        if any(wait in stack for wait in WAITS):
            waiting += n
            continue
        frames = [frame_name(f) for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        for name in set(frames):
            anywhere[name] += n
    per = 1e6 / RATE / recorded
    print(f"# {raw}: {count_line.strip()}; {note}")
    print(f"# {total} samples at {RATE} Hz = {total * per:.0f} us CPU per request (py-spy --native; "
          f"{waiting} samples waiting in epoll, a sleep or the executor's queue left out)")
    # the roots every sample shares (the loop's run, runpy…) say nothing: left out
    anywhere = collections.Counter({name: n for name, n in anywhere.items() if n < 0.6 * total})
    phases: collections.Counter = collections.Counter()
    for name, n in own.items():
        phases[next((phase for phase, marks in PHASES if any(m in name for m in marks)), "other")] += n
    print("\n## own time by phase, share of the non-idle samples")
    for phase, n in phases.most_common():
        print(f"{100 * n / total:5.1f}%  {phase}")
    for title, table in (("self", own), ("inclusive (frames on < 60% of the stacks)", anywhere)):
        print(f"\n## top {TOP} by {title} time, us CPU per request")
        for name, n in table.most_common(TOP):
            print(f"{n * per:8.1f}  {100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
