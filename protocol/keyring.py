"""Signing keys, the trust store, rotation, and the key file format.

- ``SigAlg``   — ``HMAC_SHA256`` (one cluster key shared by producers and consumers, the
                 default) or ``ED25519`` (producers hold private keys, consumers a trust
                 store of public keys, so a consumer node cannot forge).
- ``SigningKey`` — one key: an 8-byte id, its algorithm, its secret (HMAC secret or
                 Ed25519 private seed; ``None`` for a trusted public key), its public key,
                 and ``not_after_ns`` (end of the verification grace after rotation).
- ``Keyring``  — keys by id and the active signing key. ``rotate()`` makes a new key active
                 and keeps the old one for verification until the grace ends; ``retire()``
                 drops a key. ``get_for_verify(key_id)`` returns ``None`` for unknown or
                 expired ids, which the sealed-object reader turns into ``BadSignature``.
- Key file: JSON ``{"format": "statetier-keyring/1", "active": ID, "keys": [...]}`` with
  base64 secrets, written with mode 0600 by ``Keyring.save`` (``statetier keygen``).

The payload-digest key is derived from the signing material (HMAC) or the public key
(Ed25519) with BLAKE3's key derivation, so the keyed digest is a MAC under HMAC keys.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import ConfigError

KEY_ID_BYTES = 8
KEYRING_FORMAT = "statetier-keyring/1"
_DIGEST_CONTEXT = "statetier 2026-11 payload digest key v1"


class SigAlg(enum.IntEnum):
    HMAC_SHA256 = 1
    ED25519 = 2

    @property
    def signature_bytes(self) -> int:
        return 32 if self is SigAlg.HMAC_SHA256 else 64

    @property
    def label(self) -> str:
        return "hmac-sha256" if self is SigAlg.HMAC_SHA256 else "ed25519"

    @classmethod
    def from_label(cls, label: str) -> "SigAlg":
        for alg in cls:
            if alg.label == label:
                return alg
        raise ConfigError(f"unknown key algorithm {label!r}; expected hmac-sha256 or ed25519")


def _derive_digest_key(material: bytes) -> bytes:
    import blake3  # local import: keeps `statetier.protocol` import light

    return blake3.blake3(material, derive_key_context=_DIGEST_CONTEXT).digest()


def _ed25519_public(seed: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass(frozen=True)
class SigningKey:
    key_id: bytes
    alg: SigAlg
    secret: bytes | None
    public: bytes = b""
    created_at_ns: int = 0
    not_after_ns: int | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def can_sign(self) -> bool:
        return self.secret is not None

    @property
    def digest_key(self) -> bytes:
        cached: bytes | None = self._cache.get("digest_key")
        if cached is None:
            material = self.secret if self.alg is SigAlg.HMAC_SHA256 else self.public
            cached = self._cache["digest_key"] = _derive_digest_key(material or b"")
        return cached

    def sign(self, message: bytes | memoryview) -> bytes:
        if self.secret is None:
            raise ConfigError(f"key {self.key_id.hex()} holds no secret: it can verify, not sign")
        if self.alg is SigAlg.HMAC_SHA256:
            return hmac.digest(self.secret, message, "sha256")
        return self._private(self.secret).sign(bytes(message))

    def verify(self, message: bytes | memoryview, signature: bytes | memoryview) -> bool:
        if self.alg is SigAlg.HMAC_SHA256:
            if self.secret is None:
                return False
            return hmac.compare_digest(hmac.digest(self.secret, message, "sha256"), bytes(signature))
        from cryptography.exceptions import InvalidSignature

        try:
            self._public().verify(bytes(signature), bytes(message))
        except InvalidSignature:
            return False
        return True

    def _private(self, secret: bytes) -> Ed25519PrivateKey:
        key: Ed25519PrivateKey | None = self._cache.get("private")
        if key is None:
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

            key = self._cache["private"] = Ed25519PrivateKey.from_private_bytes(secret)
        return key

    def _public(self) -> Ed25519PublicKey:
        key: Ed25519PublicKey | None = self._cache.get("public")
        if key is None:
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

            key = self._cache["public"] = Ed25519PublicKey.from_public_bytes(self.public)
        return key

    @classmethod
    def generate(cls, alg: SigAlg = SigAlg.HMAC_SHA256) -> "SigningKey":
        now = time.time_ns()
        key_id = os.urandom(KEY_ID_BYTES)
        if alg is SigAlg.HMAC_SHA256:
            return cls(key_id, alg, os.urandom(32), b"", now)
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        seed = os.urandom(32)
        public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(
            Encoding.Raw, PublicFormat.Raw
        )
        return cls(key_id, alg, seed, public, now)

    @classmethod
    def from_secret(cls, key_id: bytes, secret: bytes) -> "SigningKey":
        """An HMAC key from known bytes (tests, and keys provisioned by an operator)."""
        if len(key_id) != KEY_ID_BYTES or len(secret) < 16:
            raise ConfigError("an HMAC key needs an 8-byte id and a secret of at least 16 bytes")
        return cls(key_id, SigAlg.HMAC_SHA256, bytes(secret), b"", 0)

    def public_only(self) -> "SigningKey":
        if self.alg is SigAlg.HMAC_SHA256:
            raise ConfigError("an HMAC key has no public half; share the cluster key instead")
        return replace(self, secret=None, _cache={})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.key_id.hex(),
            "alg": self.alg.label,
            "created_at_ns": self.created_at_ns,
            "not_after_ns": self.not_after_ns,
        }
        if self.secret is not None:
            out["secret"] = base64.b64encode(self.secret).decode()
        if self.public:
            out["public"] = base64.b64encode(self.public).decode()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SigningKey":
        try:
            key_id = bytes.fromhex(data["id"])
            alg = SigAlg.from_label(data["alg"])
            secret = base64.b64decode(data["secret"]) if data.get("secret") else None
            public = base64.b64decode(data["public"]) if data.get("public") else b""
            created = int(data.get("created_at_ns") or 0)
            not_after = data.get("not_after_ns")
            not_after = None if not_after is None else int(not_after)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed key entry: {exc}") from exc
        if len(key_id) != KEY_ID_BYTES:
            raise ConfigError("a key id must be 8 bytes (16 hex digits)")
        if alg is SigAlg.ED25519 and len(public) != 32:
            raise ConfigError(f"ed25519 key {key_id.hex()} needs a 32-byte public key")
        if alg is SigAlg.ED25519 and secret is not None and (len(secret) != 32 or _ed25519_public(secret) != public):
            raise ConfigError(f"ed25519 key {key_id.hex()}: the secret must be a 32-byte seed matching its public key")
        if alg is SigAlg.HMAC_SHA256 and (secret is None or len(secret) < 16):
            raise ConfigError(f"hmac key {key_id.hex()} needs a secret of at least 16 bytes")
        return cls(key_id, alg, secret, public, created, not_after)


class Keyring:
    """Keys by id; one of them, holding a secret, is active for signing."""

    def __init__(self, keys: Iterable[SigningKey] = (), active_id: bytes | None = None) -> None:
        self._keys: dict[bytes, SigningKey] = {k.key_id: k for k in keys}
        if active_id is not None and active_id not in self._keys:
            raise ConfigError(f"active key {active_id.hex()} is not in the keyring")
        self._active_id = active_id

    @classmethod
    def generate(cls, alg: SigAlg = SigAlg.HMAC_SHA256) -> "Keyring":
        key = SigningKey.generate(alg)
        return cls([key], key.key_id)

    @property
    def active(self) -> SigningKey:
        if self._active_id is None:
            raise ConfigError("the keyring has no active signing key")
        return self._keys[self._active_id]

    @property
    def keys(self) -> list[SigningKey]:
        return list(self._keys.values())

    def get_for_verify(self, key_id: bytes, now_ns: int | None = None) -> SigningKey | None:
        key = self._keys.get(bytes(key_id))
        if key is None:
            return None
        if key.not_after_ns is not None and (now_ns or time.time_ns()) > key.not_after_ns:
            return None
        return key

    def add(self, key: SigningKey) -> None:
        self._keys[key.key_id] = key

    def rotate(self, grace_seconds: float = 86400.0, alg: SigAlg | None = None) -> SigningKey:
        """Make a new key active; the old active key verifies for ``grace_seconds`` more."""
        old = self.active if self._active_id is not None else None
        new = SigningKey.generate(alg or (old.alg if old else SigAlg.HMAC_SHA256))
        if old is not None:
            deadline = time.time_ns() + int(grace_seconds * 1e9)
            self._keys[old.key_id] = replace(old, not_after_ns=deadline, _cache={})
        self._keys[new.key_id] = new
        self._active_id = new.key_id
        return new

    def retire(self, key_id: bytes) -> None:
        if key_id == self._active_id:
            raise ConfigError("the active key cannot be retired; rotate first")
        self._keys.pop(key_id, None)

    def trust_store(self) -> "Keyring":
        """The public halves of Ed25519 keys: what consumers verify with."""
        return Keyring([k.public_only() for k in self._keys.values() if k.alg is SigAlg.ED25519])

    def to_json(self) -> dict[str, Any]:
        return {
            "format": KEYRING_FORMAT,
            "active": self._active_id.hex() if self._active_id else None,
            "keys": [k.to_json() for k in self._keys.values()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Keyring":
        if not isinstance(data, dict) or data.get("format") != KEYRING_FORMAT:
            raise ConfigError(f"not a statetier keyring (expected format {KEYRING_FORMAT!r})")
        keys = [SigningKey.from_json(entry) for entry in data.get("keys") or []]
        active = data.get("active")
        try:
            active_id = bytes.fromhex(active) if active else None
        except ValueError:
            raise ConfigError("keyring 'active' must be a hex key id") from None
        return cls(keys, active_id)

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # O_CREAT keeps the mode of a leftover tmp file
        with os.fdopen(fd, "w") as handle:
            json.dump(self.to_json(), handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Keyring":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"key file {path} does not exist (create one with `statetier keygen`)") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read key file {path}: {exc}") from exc
        return cls.from_json(data)


def dev_keyring(seed: bytes = b"statetier-dev") -> Keyring:
    """A deterministic HMAC keyring for tests and the embedded single-node default."""
    secret = hashlib.sha256(b"statetier/dev-key/" + seed).digest()
    key = SigningKey.from_secret(hashlib.sha256(secret).digest()[:KEY_ID_BYTES], secret)
    return Keyring([key], key.key_id)
