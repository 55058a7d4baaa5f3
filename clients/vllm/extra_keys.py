"""What vLLM folds into a block's identity besides its token ids, keyed as statetier keys it.

vLLM's block hash (``vllm/v1/core/kv_cache_utils.py``: ``generate_block_hash_extra_keys``)
covers, per block: the LoRA adapter, each multimodal input whose placeholder tokens the block
holds (its content hash and its offset in the block), ``cache_salt`` (first block only) and a
digest of the block's prompt embeddings. The connector keys the same (DESIGN §2: they are part
of the prefix), derived alike on every node: canonical bytes under BLAKE2b, no per-process
seed. An adapter is keyed by its name and the identity of its weights (``weights.py``, as the
model's), not by its path, which differs between nodes.

- ``AdapterIdentities(allow_unidentified)`` — ``of(lora_request)``: ``name`` + weights
  identity, derived once per (name, path); an adapter with no derivable identity raises
  ``unkeyable`` unless ``allow_unidentified`` (then its path stands in, logged).
- ``request_keys(request, adapters)`` → ``RequestKeys``: ``tokens`` (the prompt's ids; zeros
  where prompt embeddings stand, as vLLM's ``all_token_ids``), ``hashes(tokens, block_size,
  seed)`` (the chained prefix hashes with each block's extra keys: ``protocol.identity.
  prefix_hashes(extra_keys=…)``; a request with none hashes exactly as its token ids alone)
  and ``digests`` (per field present: ``cache_salt``, ``lora``, ``mm``, ``prompt_embeds``, a
  hex digest naming its value, for a handoff's check). Raises ``unkeyable(…)``.
- ``other_field(mine, theirs)`` — the first field whose digests differ (present on one side
  only included), or ``None``.
- ``unkeyable(field, why)`` → an ``InvalidRequest`` whose ``unkeyed_field(exc)`` is ``field``:
  the connector refuses the request by that name (a counted miss ``misses.unkeyed_<field>``,
  nothing saved), never serves it.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import prefix_hashes

from .weights import weights_identity

log = logging.getLogger("vllm.statetier")

FIELDS = ("cache_salt", "lora", "mm", "prompt_embeds")


def unkeyable(field_name: str, why: str) -> InvalidRequest:
    """A request whose identity the connector cannot derive: refused, never served.
    ``unkeyed_field(exc)`` names the field."""
    return InvalidRequest(f"{field_name}: {why}", unkeyed=field_name)


def unkeyed_field(exc: InvalidRequest) -> str:
    return str(exc.detail.get("unkeyed", "request"))


def _item(*parts: bytes | str | int) -> bytes:
    """One tagged extra key as canonical bytes: each part length-prefixed (ints as i64)."""
    out = bytearray()
    for part in parts:
        raw = struct.pack("<q", part) if isinstance(part, int) else (part.encode() if isinstance(part, str) else part)
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def _hex(*parts: bytes | str | int) -> str:
    return hashlib.blake2b(_item(*parts), digest_size=16).hexdigest()


class AdapterIdentities:
    def __init__(self, allow_unidentified: bool = False) -> None:
        self.allow_unidentified = allow_unidentified
        self._known: dict[tuple[str, str], str] = {}

    def of(self, lora_request) -> str:
        """The adapter's identity: its name and its weights' (``weights.weights_identity``)."""
        name = str(getattr(lora_request, "lora_name", "") or "")
        path = str(getattr(lora_request, "lora_path", "") or "")
        if not name:
            raise unkeyable("lora", "a LoRA request without a name")
        known = self._known.get((name, path))
        if known is None:
            known = self._known[(name, path)] = self._derived(name, path)
        return known

    def _derived(self, name: str, path: str) -> str:
        try:
            found = weights_identity(path) if path else None
        except InvalidRequest as exc:  # a weight file that is not what its name says
            raise unkeyable("lora", f"adapter {name!r}: {exc}") from exc
        if found is not None:
            log.info("statetier connector: LoRA adapter %s: weights identity %s (%s)", name, found.value, found.source)
            return found.value
        if self.allow_unidentified:
            log.warning("statetier connector: LoRA adapter %s: no weights identity for %r; allow_unidentified_weights "
                        "is set, so its path stands in (other weights at that path would share its state)", name, path)
            return f"path:{path}"
        raise unkeyable("lora", f"cannot tell which weights adapter {name!r} is ({path!r}: no weight files, no hub "
                                f"commit in the local cache)")


@dataclass(frozen=True)
class _Feature:
    identifier: str
    offset: int
    length: int


@dataclass
class RequestKeys:
    tokens: list[int]
    lora: str = ""                                  # name + weights identity, "" without an adapter
    salt: str = ""
    features: tuple[_Feature, ...] = ()
    embeds: Any = None                              # the prompt embeddings tensor, or None
    digests: dict[str, str] = field(default_factory=dict)
    _embed_hashes: dict[tuple[int, int], bytes] = field(default_factory=dict)

    @property
    def is_plain(self) -> bool:
        return not self.digests

    def hashes(self, tokens: Sequence[int], block_size: int, seed: int = 0) -> list[bytes]:
        """The chained hash at each full block of ``tokens`` (this request's prompt, maybe with
        decoded tokens after it), each block's extra keys folded in."""
        if self.is_plain:
            return prefix_hashes(list(tokens), block_size, seed=seed)
        blocks = len(tokens) // block_size
        extras = [self.extra(i * block_size, (i + 1) * block_size) for i in range(blocks)]
        return prefix_hashes(list(tokens), block_size, seed=seed, extra_keys=extras)

    def extra(self, start: int, end: int) -> bytes:
        """Block ``[start, end)``'s extra keys, in vLLM's order: LoRA, multimodal inputs,
        cache salt (first block), prompt embeddings."""
        parts = []
        if self.lora:
            parts.append(_item("lora", self.lora))
        for feature in self.features:  # vLLM: every input whose placeholders overlap the block
            if feature.offset < end and start < feature.offset + feature.length:
                parts.append(_item("mm", feature.identifier, feature.offset - start))
        if self.salt and start == 0:
            parts.append(_item("cache_salt", self.salt))
        if self.embeds is not None and start < len(self.embeds):
            parts.append(_item("prompt_embeds", self._embeds_digest(start, end)))
        return b"".join(parts)

    def _embeds_digest(self, start: int, end: int) -> bytes:
        known = self._embed_hashes.get((start, end))
        if known is None:
            known = self._embed_hashes[(start, end)] = tensor_digest(self.embeds[start:end])
        return known


def tensor_digest(tensor) -> bytes:
    """BLAKE2b-256 of a tensor's dtype, shape and bytes (row-major, on the CPU)."""
    from ..tensors import byte_view, tensor_bytes

    digest = hashlib.blake2b(_item(str(tensor.dtype), *map(int, tensor.shape)), digest_size=32)
    digest.update(byte_view(tensor_bytes(tensor.cpu())))
    return digest.digest()


def request_keys(request, adapters: AdapterIdentities) -> RequestKeys:
    embeds = getattr(request, "prompt_embeds", None)
    keys = RequestKeys(_keyed_tokens(request, embeds))
    lora_request = getattr(request, "lora_request", None)
    if lora_request:
        keys.lora = f"{lora_request.lora_name}\x00{adapters.of(lora_request)}"
        keys.digests["lora"] = _hex("lora", keys.lora)
    salt = getattr(request, "cache_salt", None)
    if salt:
        if not isinstance(salt, str):
            raise unkeyable("cache_salt", f"expected a string, got {type(salt).__name__}")
        keys.salt = salt
        keys.digests["cache_salt"] = _hex("cache_salt", salt)
    keys.features = _features(getattr(request, "mm_features", None) or ())
    if keys.features:
        keys.digests["mm"] = _hex("mm", *(p for f in keys.features for p in (f.identifier, f.offset, f.length)))
    if embeds is not None:
        if not hasattr(embeds, "shape") or len(embeds.shape) < 1:
            raise unkeyable("prompt_embeds", f"expected a tensor, got {type(embeds).__name__}")
        keys.embeds = embeds
        keys.digests["prompt_embeds"] = tensor_digest(embeds).hex()[:32]
    return keys


def _keyed_tokens(request, embeds) -> list[int]:
    """The ids vLLM hashes a prompt's blocks over: zeros where embeddings stand."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        if embeds is None:
            raise unkeyable("prompt_embeds", "a prompt with neither token ids nor embeddings")
        return [0] * int(embeds.shape[0])
    mask = getattr(request, "prompt_is_token_ids", None)
    if mask is None:
        return list(ids)
    return [t if is_token else 0 for t, is_token in zip(ids, mask)]


def _features(mm_features) -> tuple[_Feature, ...]:
    out = []
    for feature in mm_features:
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if not isinstance(identifier, str) or not identifier or position is None:
            raise unkeyable("mm", "a multimodal input without a content hash (identifier) or placeholder position")
        out.append(_Feature(identifier, int(position.offset), int(position.length)))
    return tuple(sorted(out, key=lambda f: f.offset))


def other_field(mine: dict[str, str], theirs: dict[str, str]) -> str | None:
    """The first field (in ``FIELDS`` order) whose value differs between two requests."""
    for name in FIELDS:
        if mine.get(name) != theirs.get(name):
            return name
    return None
