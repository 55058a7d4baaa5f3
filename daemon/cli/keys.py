"""``statetier keygen``: a new keyring (``--out``), its public trust store (``--public-out``),
or a rotation in place (``--rotate``); every file written mode 0600 (``Keyring.save``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from statetier.protocol.errors import ConfigError
from statetier.protocol.keyring import Keyring, SigAlg


def run_keygen(args: argparse.Namespace) -> int:
    alg = SigAlg.from_label(args.alg) if args.alg else None
    if args.rotate is not None:
        path = Path(args.rotate)
        keyring = Keyring.load(path)
        old = keyring.active
        new = keyring.rotate(grace_seconds=args.grace_seconds, alg=alg)
        _save(keyring, path)
        print(f"rotated {path}: active key {new.key_id.hex()} ({new.alg.label}); "
              f"{old.key_id.hex()} verifies for {args.grace_seconds:g} s more")
    else:
        path = Path(args.out)
        _refuse_overwrite(path, args.force)
        keyring = Keyring.generate(alg or SigAlg.HMAC_SHA256)
        _save(keyring, path)
        print(f"wrote {path}: key {keyring.active.key_id.hex()} ({keyring.active.alg.label}), mode 0600")
    if args.public_out is not None:
        public = Path(args.public_out)
        if keyring.active.alg is not SigAlg.ED25519:
            raise ConfigError("--public-out needs ed25519 keys; an HMAC key has no public half")
        _refuse_overwrite(public, args.force)
        _save(keyring.trust_store(), public)
        print(f"wrote {public}: trust store with {len(keyring.trust_store().keys)} public key(s)")
    return 0


def _refuse_overwrite(path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise ConfigError(f"{path} exists; pass --force to overwrite it")


def _save(keyring: Keyring, path: Path) -> None:
    try:
        keyring.save(path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from exc
