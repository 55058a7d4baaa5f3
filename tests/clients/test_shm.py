"""A connection's shared-memory windows: real memfds, passed descriptors, real mappings.

The daemon side (``daemon/server/windows.py``) creates them; the client side (``clients/shm.py``)
maps them; ``clients/copies.py`` fills the put window and lands loads from the load
window, verifying each tensor where it lands.
"""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from statetier.clients.shm import ClientWindows, _FreeList
from statetier.clients.tensors import spec_of, tensor_bytes
from statetier.clients.copies import fill, laid_out, land
from statetier.clients.handshake import WindowFds
from statetier.daemon.server.windows import Windows
from statetier.protocol.errors import CorruptPayload, InvalidRequest
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, new_state_id
from statetier.protocol.keyring import dev_keyring
from statetier.protocol.sealed import layout_payload, parse_header, seal

WINDOW = 1 << 20


@pytest.fixture
def windows():
    daemon = Windows.open(WINDOW, WINDOW)
    put_fd, load_fd = (os.dup(fd) for fd in daemon.fds_for_client())  # what SCM_RIGHTS hands over
    client = ClientWindows.open(WindowFds(put_fd, WINDOW, load_fd, WINDOW))
    yield daemon, client
    client.close()
    daemon.close()


def tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(3, 8192, generator=gen)[:, :100].to(torch.bfloat16),  # non-contiguous source
            torch.tensor(7, dtype=torch.int64), torch.empty(0, 4), torch.randn(16, 16, generator=gen)]


def sealed_header(layout, payload):
    key = StateKey(NamespaceSpec(model_id="shm-tests").namespace(), Kind.KV, 0, bytes(32), 0, 16)
    header = seal(key, Provenance("r"), layout, payload, keyring=dev_keyring(), state_id=new_state_id(), version=1)
    return parse_header(header)


def test_a_put_window_fill_is_what_the_daemon_reads_and_lands_back_exactly(windows) -> None:
    daemon, client = windows
    originals = tensors()
    layout = layout_payload([spec_of(f"t{i}", t) for i, t in enumerate(originals)])
    offset = client.allocate(layout.payload_len)
    fill(client.put_window[offset : offset + layout.payload_len], layout, originals)

    seen = daemon.put_view(offset, layout.payload_len)  # the daemon's own mapping
    header = sealed_header(layout, bytes(seen))
    region_id, load_offset, dest = daemon.place(layout.payload_len)
    dest[:] = seen
    dests = [torch.empty(t.spec.shape, dtype=o.dtype) for t, o in zip(header.tensors, originals)]
    land(header, client.load_window[load_offset : load_offset + layout.payload_len], laid_out(header, None), dests,
         None)
    for got, want in zip(dests, originals):
        assert torch.equal(tensor_bytes(got), tensor_bytes(want.contiguous()))
    assert daemon.free(region_id) and not daemon.free(region_id)


def test_the_load_window_cannot_be_written_by_the_client(windows) -> None:
    daemon, client = windows
    with pytest.raises(TypeError):
        client.load_window[0:1] = b"x"
    _put_fd, load_fd = daemon.fds_for_client()
    with pytest.raises(PermissionError):  # the descriptor itself is read-only
        mmap.mmap(load_fd, WINDOW, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.write(load_fd, b"x")


def test_a_byte_changed_before_landing_is_corrupt_payload_and_into_is_filled_in_place(windows) -> None:
    daemon, client = windows
    page = torch.randn(64, 64)
    layout = layout_payload([spec_of("k", page)])
    header = sealed_header(layout, tensor_bytes(page).numpy().tobytes())
    _rid, offset, dest = daemon.place(layout.payload_len)
    dest[:] = tensor_bytes(page).numpy().tobytes()
    into = torch.zeros(64, 64)
    address = into.data_ptr()
    land(header, client.load_window[offset : offset + layout.payload_len], laid_out(header, None), [into], None)
    assert torch.equal(into, page) and into.data_ptr() == address

    dest[100] ^= 0x01  # a writer of the window changes one byte after the daemon's check
    with pytest.raises(CorruptPayload, match="'k'"):
        land(header, client.load_window[offset : offset + layout.payload_len], laid_out(header, None),
             [torch.zeros(64, 64)], None)


def test_put_view_outside_the_window_is_refused(windows) -> None:
    daemon, _client = windows
    with pytest.raises(InvalidRequest, match="outside"):
        daemon.put_view(WINDOW - 8, 16)


def test_the_put_window_free_list_coalesces_and_refuses_when_full() -> None:
    free = _FreeList(4096)
    a, b, c = free.allocate(1000), free.allocate(1000), free.allocate(1000)
    assert (a, b, c) == (0, 1024, 2048)
    assert free.allocate(2048) is None
    free.free(b)
    free.free(a)
    assert free.allocate(2048) == 0  # a and b merged
    free.free(c)
    free.free(0)
    assert free.allocate(4096) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_destination_is_verified_in_a_private_staging_buffer(windows) -> None:
    daemon, client = windows
    page = torch.randn(128, 128)
    raw = tensor_bytes(page).numpy().tobytes()
    layout = layout_payload([spec_of("k", page)])
    header = sealed_header(layout, raw)
    _rid, offset, dest = daemon.place(layout.payload_len)
    dest[:] = raw
    staging = torch.empty(len(raw), dtype=torch.uint8, pin_memory=True)
    into = torch.zeros(128, 128, device="cuda")
    land(header, client.load_window[offset : offset + len(raw)], laid_out(header, None), [into], lambda n: staging)
    assert torch.equal(into.cpu(), page)
    dest[5] ^= 1
    untouched = torch.full((128, 128), 3.0, device="cuda")
    with pytest.raises(CorruptPayload):
        land(header, client.load_window[offset : offset + len(raw)], laid_out(header, None), [untouched],
             lambda n: staging)
    assert bool((untouched == 3.0).all())  # nothing unverified reached the device
