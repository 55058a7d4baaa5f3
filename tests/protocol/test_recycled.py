"""protocol.recycled: large buffers recycled once nothing uses them (issue 33)."""

from __future__ import annotations

import ctypes
import gc

from statetier.protocol.frames import Frame, FrameDecoder, Op, encode_frame_bytes
from statetier.protocol.recycled import FRAME_MEMORY, RecycledMemory, frame_buffer, size_class
from statetier.protocol.thresholds import RECYCLED_BUFFER_BYTES


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_size_classes_waste_at_most_an_eighth():
    for nbytes in (1, 4096, 4097, 1 << 20, (1 << 20) + 1, 3 << 20, (8 << 20) + 12345, 65 << 20):
        size = size_class(nbytes)
        assert size >= nbytes and size % 4096 == 0
        assert size <= max(4096, nbytes * 9 // 8 + 4096), (nbytes, size)
    assert size_class(2 << 20) == 2 << 20 and size_class((2 << 20) + 1) == (2 << 20) + (256 << 10)


def test_a_view_or_slice_still_in_use_keeps_its_memory_out_of_the_pool():
    memory = RecycledMemory(keep_bytes=16 << 20)
    first = memory.view(3 << 20)
    first[:] = b"\x07" * len(first)
    address = _address(first)
    piece = first[100:200]
    del first
    gc.collect()
    second = memory.view(3 << 20)
    assert _address(second) != address and memory.handed_out == 2 and bytes(piece) == b"\x07" * 100
    del piece
    gc.collect()
    assert memory.handed_out == 1 and memory.kept_bytes == size_class(3 << 20)
    third = memory.view((3 << 20) - 5000)  # the same size class
    assert _address(third) == address and memory.kept_bytes == 0


def test_past_keep_bytes_a_freed_mapping_is_unmapped():
    memory = RecycledMemory(keep_bytes=4 << 20)
    views = [memory.view(4 << 20) for _ in range(2)]
    del views
    gc.collect()
    assert memory.kept_bytes == 4 << 20 and memory.handed_out == 0


def test_small_buffers_are_plain_bytearrays():
    assert isinstance(frame_buffer(RECYCLED_BUFFER_BYTES - 1), bytearray)
    assert isinstance(frame_buffer(RECYCLED_BUFFER_BYTES), memoryview)


def test_a_large_frame_is_received_into_recycled_memory_and_given_back():
    payload = bytes(range(256)) * ((2 << 20) // 256)
    wire = encode_frame_bytes(Frame(Op.LOAD, 7, {"a": 1}, payload))
    gc.collect()  # what earlier tests left for the collector given back first
    before = FRAME_MEMORY.handed_out
    decoder = FrameDecoder()
    frames = []
    for start in range(0, len(wire), 100_000):  # in pieces, as a socket delivers it
        frames += decoder.feed(wire[start : start + 100_000])
    (frame,) = frames
    assert bytes(frame.data) == payload and frame.meta == {"a": 1}
    assert FRAME_MEMORY.handed_out == before + 1
    del frame, frames
    gc.collect()
    assert FRAME_MEMORY.handed_out == before
