"""The daemon-to-daemon frames and the handshake that authenticates both ends.

Handshake (both ends hold the cluster keyring; HMAC-SHA256 keys only), every MAC under the
peer-auth key ``K = HMAC(secret, "statetier/peer-auth/1")`` derived from the signing key
named by id (never the signing key itself, so no handshake MAC is a valid object signature):

    puller → owner   HELLO   magic(8) key_id(8) nonce_p(32)
    owner  → puller  WELCOME key_id(8) nonce_o(32) HMAC(K, "owner" | nonce_p | nonce_o [| n | owner_id])
                     [n(1) owner_id(n)]
                     (all zeros: REFUSED, the puller's key id is not in this keyring)
    puller → owner   PROVE   HMAC(K, "puller" | nonce_p | nonce_o)

The bracketed parts answer a ``MAGIC_OWNER`` hello only: the owner id of the process that
answers (``owner_id``, as its directory entries name it), under the owner's MAC, so a puller
knows a restarted daemon (a new owner id) from the one it pulled from before. An owner
answers a ``MAGIC`` hello (a daemon of the release before) as it did, without it.

then the session key ``S = HMAC(K, "session" | nonce_p | nonce_o)`` authenticates every
request: ``PULL object_id(16) tenant_tag(16) size(8) seq(8) HMAC(S, the 48 bytes)(32)``
(``seq`` counts up, so a request cannot be replayed on the connection). The answer is
``status(1) length(8)`` then ``length`` bytes: the sealed object as the owner holds it,
whose signed header and digests the puller verifies where the bytes land.

A batch from one owner is one request, ``PULL_MANY``: a PULL frame naming the object id
``MANY`` with ``size`` = how many objects (at most ``MANY_AT_MOST``), then that many
``object_id(16) tenant_tag(16) size(8)`` items and ``HMAC(S, seq | the items)(32)``. The owner
answers ``BATCH`` (``length`` = the count), then each object's answer (head and bytes) back
to back, in order, with no request between them. An owner that predates it answers the head
``NOT_HERE`` (no object has that id) and drops the connection at the items: the puller then
pulls that owner's objects one by one.

A puller that wants the bytes encrypted (``peers.encrypt``, ``tiers.peer.sealing``) sets the
top bit of a PULL's ``size`` (``SEALED``), or of each PULL_MANY item's; the owner then answers
``OK_SEALED`` (``length`` = the object's size) followed by the object sealed in chunks (each
its ciphertext and its 16-byte tag, ``sealing.sealed_length(length)`` bytes in all), whatever
its own ``peers.encrypt`` says. An owner that predates it never reads ``size``: it answers
``OK`` and the bytes in the clear, which such a puller refuses (``PeerLost``, the connection
closed unread). A puller that does not ask is answered ``OK``, as before.

The NIXL transport (``tiers.peer.nixl``) asks for an object in place instead: a PULL of the
object id ``EXPOSE`` then the object's PULL (the next ``seq``), sent together. An owner with
a NIXL agent answers the head ``FABRIC``, then the object ``EXPOSED`` (``length`` = its size)
followed by ``EXPOSED_AT`` (its address in the owner's registered arena) and the owner's
agent name: the lease holds it until the puller's PULL of ``DONE`` (the next ``seq``) or the
connection's end. An object outside that arena is answered ``OK`` and its bytes, as any
pull. An owner without NIXL answers the head ``NOT_HERE`` (no object has that id) and the
object as any pull.
"""

from __future__ import annotations

import hmac
import struct
from typing import Sequence

from statetier.protocol.errors import ConfigError, Unauthorized
from statetier.protocol.keyring import Keyring, SigAlg, SigningKey

MAGIC = b"STPEER01"
MAGIC_OWNER = b"STPEER02"  # the puller asks who answers: the owner id follows the WELCOME
NONCE_BYTES = 32
MAC_BYTES = 32
HELLO_BYTES = len(MAGIC) + 8 + NONCE_BYTES
WELCOME_BYTES = 8 + NONCE_BYTES + MAC_BYTES
PULL = struct.Struct("<16s16sQQ")
PULL_BYTES = PULL.size + MAC_BYTES
ANSWER = struct.Struct("<BQ")

PULL_ITEM = struct.Struct("<16s16sQ")
MANY = b"\xffstatetier-many\xff"  # the object id a PULL_MANY head names (no state id is this)
MANY_AT_MOST = 4096  # objects in one PULL_MANY

OK, NOT_HERE, FORBIDDEN, BATCH, OK_SEALED = 0, 1, 2, 3, 4
SEALED = 1 << 63  # the bit of a pull's size that asks for the answer sealed (AES-GCM)
EXPOSE = b"\xffstatetier-nixl\xff"  # the object id of the head of a NIXL request
DONE = b"\xffstatetier-done\xff"  # the object id of a NIXL request's end: the lease released
FABRIC, EXPOSED = 16, 17  # the answers to EXPOSE's head and to its object
EXPOSED_AT = struct.Struct("<QB")  # the object's address in the owner's arena, its agent name's length
REFUSED = bytes(WELCOME_BYTES)  # the WELCOME to a puller whose key id this keyring lacks


def auth_key(key: SigningKey) -> bytes:
    if key.alg is not SigAlg.HMAC_SHA256 or key.secret is None:
        raise ConfigError("peers: daemon-to-daemon authentication needs an HMAC-SHA256 cluster keyring "
                          "(an Ed25519 trust store holds no secret both ends share)")
    return hmac.digest(key.secret, b"statetier/peer-auth/1", "sha256")


def key_for(keyring: Keyring, key_id: bytes) -> bytes:
    """The peer-auth key of ``key_id`` (a key in its rotation grace is accepted too)."""
    key = keyring.get_for_verify(key_id)
    if key is None:
        raise Unauthorized(f"peer: key id {key_id.hex()} is not in this cluster's keyring")
    return auth_key(key)


def mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"".join(parts), "sha256")


def owner_proof(key: bytes, nonce_p: bytes, nonce_o: bytes, owner_id: bytes | None) -> bytes:
    """The owner's MAC of a WELCOME; ``owner_id`` None: the first release's, without it."""
    if owner_id is None:
        return mac(key, b"owner", nonce_p, nonce_o)
    return mac(key, b"owner", nonce_p, nonce_o, bytes([len(owner_id)]), owner_id)


def owner_id_bytes(owner_id: str) -> bytes:
    """An owner id as the WELCOME carries it (at most 255 bytes; its length goes first)."""
    return owner_id.encode()[:255]


def session_key(key: bytes, nonce_p: bytes, nonce_o: bytes) -> bytes:
    return mac(key, b"session", nonce_p, nonce_o)


def pack_pull(session: bytes, object_id: bytes, tenant_tag: bytes, size: int, seq: int) -> bytes:
    body = PULL.pack(object_id, tenant_tag, size, seq)
    return body + mac(session, body)


def unpack_pull(session: bytes, frame: bytes, expected_seq: int) -> tuple[bytes, bytes, int]:
    body, tag = frame[: PULL.size], frame[PULL.size :]
    if not hmac.compare_digest(mac(session, body), tag):
        raise Unauthorized("peer: a pull request's MAC does not verify")
    object_id, tenant_tag, size, seq = PULL.unpack(body)
    if seq != expected_seq:
        raise Unauthorized("peer: a pull request out of sequence (replayed?)")
    return object_id, tenant_tag, size


def pack_pull_many(session: bytes, items: Sequence[tuple[bytes, bytes, int]], seq: int) -> bytes:
    """A PULL_MANY: its head (a PULL of ``MANY``), the items, their MAC bound to ``seq``."""
    if not 0 < len(items) <= MANY_AT_MOST:
        raise ValueError(f"a PULL_MANY names 1 to {MANY_AT_MOST} objects, not {len(items)}")
    body = b"".join(PULL_ITEM.pack(object_id, tenant_tag, size) for object_id, tenant_tag, size in items)
    return pack_pull(session, MANY, bytes(16), len(items), seq) + body + mac(session, seq.to_bytes(8, "little"), body)


def asking(size: int, sealed: bool) -> int:
    """A pull's ``size`` field: the object's size, with ``SEALED`` when the answer is to be sealed."""
    return size | SEALED if sealed else size


def asked(size: int) -> tuple[int, bool]:
    """(the object's size, whether the answer is to be sealed) of a pull's ``size`` field."""
    return size & ~SEALED, bool(size & SEALED)


def many_bytes(count: int) -> int:
    """What follows a PULL_MANY head of ``count`` objects: the items and their MAC."""
    if not 0 < count <= MANY_AT_MOST:
        raise Unauthorized(f"peer: a PULL_MANY of {count} objects (1 to {MANY_AT_MOST})")
    return count * PULL_ITEM.size + MAC_BYTES


def unpack_pull_many(session: bytes, frame: bytes, seq: int) -> list[tuple[bytes, bytes, int]]:
    body, tag = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
    if not hmac.compare_digest(mac(session, seq.to_bytes(8, "little"), body), tag):
        raise Unauthorized("peer: a PULL_MANY's items do not verify")
    return [PULL_ITEM.unpack_from(body, at) for at in range(0, len(body), PULL_ITEM.size)]
