"""What the fault suite and its plain-Redis contrast share: the scenarios, the decode, the damage.

- ``ARCHS`` — the five architectures of issue 5; ``PROMPT_LEN`` (N), ``NEW_TOKENS``, ``K_EARLIER``.
- ``scenario(arch)`` → ``Scenario`` (cached): the tiny model (seed 0), its ``CachePlan``, the
  prompt P and another prompt Q of the same length, the greedy token after P, the reference
  (single-process generation) and ``target`` / ``neighbour``: the first two SSM layers (the
  damage faults flip ``target``'s bytes; the plain-Redis contrast swaps their snapshots,
  same shapes). ``other_weights(arch)`` — seed 1.
- ``prefilled(model, tokens)`` — the cache after ``tokens`` and the token after them (cached;
  never decode on it, decoding mutates a cache).
- ``ForwardCounter(model)`` — counts the model's forwards inside a ``with`` block: a refused
  restore must leave it at 0 (no token was decoded from the bad state).
- ``flip_site(snapshot, layer=None)`` → ``(tensor name, byte index, mask)``: the one bit both
  suites flip, the exponent's high bit of the largest value below 2 in ``recurrent_states.0``
  (×2¹²⁸); with ``layer`` the name is that layer's region of a group object.
- Stored bytes: ``is_in_redis`` / ``redis_blob`` / ``write_redis_blob`` / ``flip_redis_bit``
  (the Redis tier's manifest and chunk keys, tiers/redis/layout.py); ``flip_disk_bit`` (a
  segment record, tiers/disk/segments.py); ``forged_blob`` — an object re-sealed by a writer
  holding another key; ``write_under_another_key`` (Redis: another object's chunk, and
  optionally its manifest, under this object's keys) and ``overwrite_in_arena`` (another
  object's sealed bytes over this one's region of the daemon's arena, in place): a mix-up
  of two keys.
- ``Counters`` — one scrape of a daemon's /metrics: rejections by reason, misses by kind,
  load requests served, hits, lookups and the tokens they answered; ``changes(before,
  after)`` is what moved.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from examples.tiny_hybrids import build_model, prefill, prompt, reference_tokens
from statetier.clients.transformers import CachePlan, cache_plan
from statetier.protocol.groups import region_name
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import decode_header, layout_payload, seal
from statetier.tiers.redis.layout import Manifest, RedisKeys
from tests.support.daemons import arena_copy

ARCHS = ("jamba", "bamba", "zamba2", "qwen3_next", "mamba2")
PROMPT_LEN = 20
NEW_TOKENS = 6
K_EARLIER = 4
RECURRENT = "recurrent_states.0"


@dataclass(frozen=True)
class Scenario:
    arch: str
    model: torch.nn.Module
    plan: CachePlan
    prompt: list[int]
    other_prompt: list[int]
    first: int
    reference: list[int]

    @property
    def target(self) -> int:
        return self.plan.ssm_layers[0]

    @property
    def neighbour(self) -> int:
        return self.plan.ssm_layers[1]


@functools.cache
def scenario(arch: str) -> Scenario:
    model = build_model(arch, seed=0)
    tokens = prompt(seed=1, length=PROMPT_LEN)
    reference = reference_tokens(model, tokens, NEW_TOKENS)
    return Scenario(arch, model, cache_plan(model.config), tokens, prompt(seed=2, length=PROMPT_LEN),
                    reference[0], reference)


@functools.cache
def other_weights(arch: str) -> torch.nn.Module:
    return build_model(arch, seed=1)


_prefills: dict[tuple[int, tuple[int, ...]], tuple] = {}


def prefilled(model, tokens: list[int]):
    """``(cache, next token)`` after ``tokens``; shared, so only read it (save, copy)."""
    key = (id(model), tuple(tokens))
    if key not in _prefills:
        _prefills[key] = prefill(model, tokens)
    return _prefills[key]


class ForwardCounter:
    """Counts ``model`` forwards while the ``with`` block runs."""

    def __init__(self, model) -> None:
        self.model, self.calls, self._hook = model, 0, None

    def __enter__(self) -> "ForwardCounter":
        self._hook = self.model.register_forward_pre_hook(self._count)
        return self

    def _count(self, *_args) -> None:
        self.calls += 1

    def __exit__(self, *exc_info) -> None:
        self._hook.remove()


# -- the flipped bit -----------------------------------------------------------------------


def flip_site(snapshot: dict[str, torch.Tensor], layer: int | None = None) -> tuple[str, int, int]:
    """The byte (of ``recurrent_states.0``) and mask of the flipped bit.

    Many single-bit flips leave six greedy tokens of these tiny models unchanged (a sign bit,
    or the exponent bit of a value >= 2, measured): still wrong state, not yet wrong tokens.
    The high exponent bit of a value below 2 multiplies it by 2**128, which every one of the
    five models turns into other tokens, so the contrast can show it. Same site in both suites.
    """
    values = snapshot[RECURRENT].detach().reshape(-1).float()
    assert snapshot[RECURRENT].dtype == torch.float32
    below_two = torch.where(values.abs() < 2, values.abs(), torch.zeros_like(values))
    element = int(below_two.argmax())
    name = RECURRENT if layer is None else region_name(layer, RECURRENT)
    return name, element * 4 + 3, 0x40  # little-endian float32: byte 3 holds sign + exponent


# -- stored bytes --------------------------------------------------------------------------

KEYS = RedisKeys("st")  # the daemons' default redis.key_prefix


def is_in_redis(redis, state_id: bytes) -> bool:
    return bool(redis.exists(KEYS.manifest(state_id)))


def _manifest(redis, state_id: bytes) -> Manifest:
    raw = redis.get(KEYS.manifest(state_id))
    assert raw is not None, f"object {state_id.hex()} is not in Redis"
    manifest = Manifest.decode(raw)
    assert manifest.chunks == 1 and not manifest.is_encrypted, manifest  # tiny objects: one plain chunk
    return manifest


def redis_blob(redis, state_id: bytes) -> bytes:
    """The sealed object (header + payload) the Redis tier stores under ``state_id``."""
    _manifest(redis, state_id)
    return redis.get(KEYS.chunk(state_id, 0))


def write_redis_blob(redis, state_id: bytes, blob: bytes) -> None:
    assert len(blob) == _manifest(redis, state_id).stored_size
    redis.set(KEYS.chunk(state_id, 0), blob, keepttl=True)


def payload_offset(blob: bytes, tensor: str) -> int:
    """Offset in the sealed object of ``tensor``'s first byte."""
    header = decode_header(blob)
    (descriptor,) = [t for t in header.tensors if t.spec.name == tensor]
    return header.header_len + descriptor.offset


def flip_redis_bit(redis, state_id: bytes, snapshot: dict[str, torch.Tensor], layer: int | None = None) -> None:
    """SETRANGE one byte of the stored payload: the bit of ``flip_site``."""
    name, byte, mask = flip_site(snapshot, layer)
    at = payload_offset(redis_blob(redis, state_id), name) + byte
    old = redis.getrange(KEYS.chunk(state_id, 0), at, at)
    redis.setrange(KEYS.chunk(state_id, 0), at, bytes([old[0] ^ mask]))


_RECORD_MAGIC = b"STRC"
_RECORD_ID_AT = 16  # tiers/disk/segments.py: the object_id in a record header
RECORD_HEADER_BYTES = 64


def flip_disk_bit(disk_dir: Path, state_id: bytes, snapshot: dict[str, torch.Tensor],
                  layer: int | None = None) -> Path:
    """Flip the ``flip_site`` bit of the record of ``state_id`` in its segment file."""
    name, byte, mask = flip_site(snapshot, layer)
    for segment in sorted((disk_dir / "segments").glob("seg-*.dat")):
        data = segment.read_bytes()
        at = data.find(state_id)
        while at >= 0:
            start = at - _RECORD_ID_AT
            if start >= 0 and data[start : start + 4] == _RECORD_MAGIC:
                (body_len,) = struct.unpack_from("<Q", data, start + 8)
                body = data[start + RECORD_HEADER_BYTES : start + RECORD_HEADER_BYTES + body_len]
                where = start + RECORD_HEADER_BYTES + payload_offset(body, name) + byte
                with open(segment, "r+b") as file:
                    file.seek(where)
                    file.write(bytes([data[where] ^ mask]))
                return segment
            at = data.find(state_id, at + 1)
    raise AssertionError(f"no segment record of {state_id.hex()} under {disk_dir}")


def forged_blob(genuine: bytes, substitute: bytes, forger: Keyring) -> bytes:
    """``substitute``'s payload under ``genuine``'s identity, re-sealed with ``forger``'s key.

    The forger rewrites every header field (request, prefix, state_id, version, digests) so
    that only the signature can tell: what a writer without the cluster key can produce.
    """
    mine, theirs = decode_header(genuine), decode_header(substitute)
    payload = substitute[theirs.header_len :]
    layout = layout_payload([t.spec for t in theirs.tensors])
    header = seal(mine.key, mine.provenance, layout, payload, keyring=forger, state_id=mine.state_id,
                  version=mine.version, digest_alg=mine.digest_alg)
    return header + payload


# -- metrics -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    """The counters of one scrape that the suite asserts on, as a flat ``{name: value}``."""

    values: dict

    @classmethod
    def of(cls, daemon) -> "Counters":
        samples = daemon.scrape()
        out: dict = {}
        for labels, value in samples.matching("statetier_rejections_total").items():
            out[f"rejected:{dict(labels)['reason']}"] = value
        for labels, value in samples.matching("statetier_misses_total").items():
            out[f"miss:{dict(labels)['kind']}"] = value
        out["loads"] = sum(v for labels, v in samples.matching("statetier_operations_total").items()
                           if dict(labels).get("op") == "load" and dict(labels).get("tier") == "daemon")
        out["hits"] = sum(samples.matching("statetier_hits_total").values())
        out["lookups"] = samples.value("statetier_lookup_hit_tokens_count")
        out["lookup_tokens"] = samples.value("statetier_lookup_hit_tokens_sum")
        return cls(out)


def changes(before: Counters, after: Counters, *prefixes: str) -> dict:
    """What moved between two scrapes (only names starting with one of ``prefixes``, if given)."""
    names = set(before.values) | set(after.values)
    moved = {n: after.values.get(n, 0) - before.values.get(n, 0) for n in names}
    return {n: d for n, d in sorted(moved.items()) if d and (not prefixes or n.startswith(prefixes))}


# -- a connector that writes to the wrong key ----------------------------------------------


def write_under_another_key(redis, target: bytes, source: bytes, *, with_manifest: bool) -> None:
    """Object ``source``'s stored bytes SET under ``target``'s chunk key, and with
    ``with_manifest`` its manifest under ``target``'s manifest key too: what a connector that
    mixed up two keys writes into Redis."""
    redis.set(KEYS.chunk(target, 0), redis_blob(redis, source), keepttl=True)
    if with_manifest:
        redis.set(KEYS.manifest(target), redis.get(KEYS.manifest(source)), keepttl=True)


def overwrite_in_arena(node, ref, blob: bytes) -> None:
    """Write the sealed ``blob`` over the arena copy of ``ref`` in ``node``'s daemon, in place
    (the copy's index entry unchanged). Clients no longer map the arena (each connection gets
    windows of its own), so this is what only a process that can write the daemon's memory
    could do (a daemon bug, root): the arena is opened through ``/proc/<pid>/fd`` and the
    object found by its state_id. Same-size objects only: an arena copy is read back at its
    indexed size."""
    with arena_copy(node.pid, ref.state_id) as (arena, at, length):
        assert length == len(blob), "same-size objects only"
        arena[at : at + len(blob)] = blob
