"""Hashing on more than one core above one measured size (issue 21, item 2).

BLAKE3 of a region of ``PARALLEL_HASH_BYTES`` or more is asked for several threads
(``max_threads=blake3.AUTO``), below it for one: when the daemon seals or checks a payload
(``digest_region``) and when a client verifies one where it landed (``region_hasher``,
fed in ``hash_chunk`` pieces large enough for the threads to share). The digests are the
same either way: a region sealed on one thread verifies on several.
"""

from __future__ import annotations

import os

import blake3
import pytest
import torch

from statetier.clients.copies import laid_out, land
from statetier.protocol import digests
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, new_state_id
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import decode_header, seal_object
from statetier.protocol.thresholds import PARALLEL_HASH_BYTES


_REAL = blake3.blake3


class CountingBlake3:
    """The real ``blake3.blake3``, remembering each hasher's ``max_threads`` and update sizes."""

    AUTO = _REAL.AUTO

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.updates: list[int] = []

    def __call__(self, data=b"", max_threads: int = 1):
        self.threads.append(max_threads)
        hasher, updates = _REAL(data, max_threads=max_threads), self.updates

        class Hasher:
            def update(self, chunk):
                updates.append(memoryview(chunk).nbytes)
                hasher.update(chunk)

            def digest(self):
                return hasher.digest()

        return Hasher()


@pytest.fixture
def counted(monkeypatch) -> CountingBlake3:
    shim = CountingBlake3()
    monkeypatch.setattr(digests.blake3, "blake3", shim)
    return shim


@pytest.mark.parametrize("size, threads", [(64 << 10, 1), (PARALLEL_HASH_BYTES - 1, 1),
                                           (PARALLEL_HASH_BYTES, _REAL.AUTO), (4 << 20, _REAL.AUTO)])
def test_a_region_is_hashed_on_several_threads_from_the_measured_size_on(counted, size, threads):
    data = os.urandom(size)
    assert digests.digest_region(digests.DigestAlg.BLAKE3, data) == _REAL(data).digest()
    assert counted.threads == [threads]


def test_a_client_verifies_a_large_region_on_several_threads_in_large_pieces(counted):
    keyring = Keyring.generate()
    key = StateKey(NamespaceSpec("parallel").namespace(), Kind.KV, 0, bytes(32), 0, 16)
    big, small = os.urandom(6 << 20), os.urandom(64 << 10)
    blob = seal_object(key, Provenance("r"), [(TensorSpec("big", "uint8", (len(big),)), big),
                                              (TensorSpec("small", "uint8", (len(small),)), small)],
                       keyring=keyring, state_id=new_state_id(), version=1)
    header = decode_header(blob)
    counted.threads.clear()
    dests = [torch.empty(len(big), dtype=torch.uint8), torch.empty(len(small), dtype=torch.uint8)]
    land(header, memoryview(blob)[header.header_len :], laid_out(header, None), dests, staging=None)
    assert bytes(dests[0].numpy()) == big and bytes(dests[1].numpy()) == small  # verified, landed
    assert counted.threads[:2] == [_REAL.AUTO, 1]  # the 6 MiB tensor on several threads, the 64 KiB one on one
    assert counted.updates[:2] == [digests.PARALLEL_CHUNK, (6 << 20) - digests.PARALLEL_CHUNK]  # pieces to share
