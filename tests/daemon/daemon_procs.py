"""What the end-to-end tests share about daemons: a fixture, Jamba-mini state, polling.

The daemon process itself is ``statetier.launch.DaemonProcess`` (also used by the
benchmarks, the examples and the reliability harness); this module adds what only tests want:

- ``daemon_fixture(request, **kw)`` — start one; at teardown SIGTERM it, print its log tail
  (pytest shows it only when the test failed), close it and assert it exited with 0.
- Jamba-mini state: ``jamba_namespace(model)``, ``snapshot(seed)`` (conv (3, 8192) bf16 +
  ssm (8192, 16) fp32), ``kv_page(seed, tokens)`` ((2, 8, tokens, 128) bf16),
  ``token_ids(seed, n)``, ``assert_same_tensors(got, want)`` (dtype, shape, every bit);
  ``eventually(predicate)`` polls a condition the daemon reaches in the background.
- ``arena_copy(pid, state_id)`` — a ``with`` block over the daemon's own host arena, mapped
  writable through ``/proc/<pid>/fd`` (what only a daemon bug or root could do: no client
  maps it), giving ``(arena, offset, length)`` of the object's copy (signed header + payload).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Mapping

import torch

from statetier.launch.daemons import DaemonProcess
from statetier.protocol.identity import NamespaceSpec


def daemon_fixture(request, **kwargs) -> DaemonProcess:
    """Start a daemon for a fixture. At teardown: SIGTERM, print the log tail (pytest shows it
    only for a failed test), remove its directory, and assert that it exited with 0."""
    daemon = DaemonProcess(**kwargs)
    served = False

    def finish() -> None:
        code = None
        try:
            if served:
                code = daemon.stop() if daemon.is_running else daemon.proc.returncode
        finally:
            print(f"--- log tail of the daemon in {daemon.directory}:\n{daemon.log_tail()}")
            daemon.close()
        assert not served or code == 0, f"the daemon exited with {code}"

    request.addfinalizer(finish)
    daemon.start()
    served = True
    return daemon


@contextmanager
def arena_copy(pid: int, state_id: bytes) -> Iterator[tuple[mmap.mmap, int, int]]:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if "statetier-host" not in os.readlink(path):
                continue
        except OSError:
            continue
        with open(path, "r+b") as handle, mmap.mmap(handle.fileno(), 0) as arena:
            at = arena.find(b"STSO")
            while at >= 0:
                if arena[at + 136 : at + 152] == state_id:  # state_id in the header (protocol.md §1.1)
                    header_len = int.from_bytes(arena[at + 8 : at + 12], "little")
                    payload_len = int.from_bytes(arena[at + 16 : at + 24], "little")
                    yield arena, at, header_len + payload_len
                    return
                at = arena.find(b"STSO", at + 1)
    raise AssertionError(f"no arena copy of {state_id.hex()} in daemon {pid}")


# -- Jamba-mini state ------------------------------------------------------------------

SSM_LAYERS = 28
ATTENTION_LAYERS = 4
BLOCK = 64


def jamba_namespace(model: str = "jamba-mini", block: int = BLOCK) -> NamespaceSpec:
    return NamespaceSpec(model_id=model, revision="r1", weight_dtype="bfloat16", kv_block_size=block,
                         kv_dtype="bfloat16", ssm_dtype="float32", conv_dtype="bfloat16", conv_layout="(3,8192)")


def snapshot(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"conv": torch.randn(3, 8192, generator=gen).to(torch.bfloat16),
            "ssm": torch.randn(8192, 16, generator=gen)}


def kv_page(seed: int, tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + seed)
    return {"kv": torch.randn(2, 8, tokens, 128, generator=gen).to(torch.bfloat16)}


def token_ids(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 65_000, (n,), generator=gen).tolist()


def assert_same_tensors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8) if tensor.dim() else got[name],
                           tensor.view(torch.uint8) if tensor.dim() else tensor), name


async def eventually(predicate, timeout: float = 20.0, interval: float = 0.05) -> None:
    """Await until ``await predicate()`` is true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s")
        await asyncio.sleep(interval)
