"""Keys: rotation with a verification grace, trust stores, and the key file on real disk."""

from __future__ import annotations

import base64
import json
import os
import stat
import time

import pytest

from statetier.protocol.errors import ConfigError
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import KEYRING_FORMAT, Keyring, SigAlg, SigningKey, dev_keyring
from statetier.protocol.sealed import open_sealed, seal_object

KEY = StateKey(NamespaceSpec("org/keys").namespace(), Kind.KV, 0, bytes(32), 0, 16)


def sealed_by(keyring: Keyring) -> bytes:
    return seal_object(KEY, Provenance("r"), [], keyring=keyring, state_id=os.urandom(16), version=1)


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---------------------------------------------------------------- rotation


@pytest.mark.parametrize("alg", list(SigAlg), ids=lambda a: a.label)
def test_rotation_keeps_the_old_key_verifying_during_the_grace(alg):
    keyring = Keyring.generate(alg)
    old = keyring.active
    before = sealed_by(keyring)
    new = keyring.rotate(grace_seconds=3600)
    assert keyring.active is new and new.key_id != old.key_id and new.alg is alg
    after = sealed_by(keyring)
    assert open_sealed(before, None, keyring).header.key_id == old.key_id
    assert open_sealed(after, None, keyring).header.key_id == new.key_id
    retained = keyring.get_for_verify(old.key_id)
    assert retained is not None and retained.not_after_ns is not None
    assert time.time_ns() < retained.not_after_ns <= time.time_ns() + 3600 * 10**9
    # the grace ends at not_after_ns: one nanosecond later the old key no longer verifies
    assert keyring.get_for_verify(old.key_id, now_ns=retained.not_after_ns) is not None
    assert keyring.get_for_verify(old.key_id, now_ns=retained.not_after_ns + 1) is None
    assert keyring.get_for_verify(new.key_id, now_ns=retained.not_after_ns + 1) is new


def test_rotation_twice_keeps_both_older_keys_for_their_grace():
    keyring = Keyring.generate()
    first = keyring.active.key_id
    second = keyring.rotate(60).key_id
    third = keyring.rotate(60).key_id
    assert {k.key_id for k in keyring.keys} == {first, second, third}
    assert all(keyring.get_for_verify(k) is not None for k in (first, second, third))


def test_retire_drops_a_key_but_never_the_active_one():
    keyring = Keyring.generate()
    old = keyring.active.key_id
    keyring.rotate(3600)
    with pytest.raises(ConfigError):
        keyring.retire(keyring.active.key_id)
    keyring.retire(old)
    assert keyring.get_for_verify(old) is None
    keyring.retire(old)  # already gone: nothing to do


def test_unknown_key_id_is_not_verifiable():
    assert Keyring.generate().get_for_verify(b"\0" * 8) is None


def test_keyring_without_an_active_key_cannot_sign():
    keyring = Keyring.generate(SigAlg.ED25519).trust_store()
    with pytest.raises(ConfigError):
        _ = keyring.active


def test_active_id_must_be_in_the_keyring():
    with pytest.raises(ConfigError):
        Keyring([], b"12345678")


def test_trust_store_holds_public_ed25519_keys_only():
    keyring = Keyring.generate(SigAlg.ED25519)
    keyring.add(SigningKey.from_secret(b"hmac-key", b"h" * 32))
    store = keyring.trust_store()
    assert [k.key_id for k in store.keys] == [keyring.active.key_id]
    (public,) = store.keys
    assert public.secret is None and not public.can_sign
    assert public.public == keyring.active.public
    assert public.digest_key == keyring.active.digest_key  # consumers derive the same digest key
    with pytest.raises(ConfigError):
        SigningKey.from_secret(b"hmac-key", b"h" * 32).public_only()


def test_hmac_digest_key_depends_on_the_secret():
    a = SigningKey.from_secret(b"same-id!", b"a" * 32)
    b = SigningKey.from_secret(b"same-id!", b"b" * 32)
    assert len(a.digest_key) == 32 and a.digest_key != b.digest_key


@pytest.mark.parametrize("key_id,secret", [(b"short", b"s" * 32), (b"12345678", b"s" * 15)])
def test_from_secret_validates_its_input(key_id, secret):
    with pytest.raises(ConfigError):
        SigningKey.from_secret(key_id, secret)


def test_dev_keyring_is_deterministic_per_seed():
    assert dev_keyring().active == dev_keyring().active
    assert dev_keyring(b"a").active.key_id != dev_keyring(b"b").active.key_id
    assert open_sealed(sealed_by(dev_keyring()), None, dev_keyring()).header.key_id == dev_keyring().active.key_id


def test_unknown_algorithm_label_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown key algorithm"):
        SigAlg.from_label("rsa")


# ---------------------------------------------------------------- key files


@pytest.mark.parametrize("alg", list(SigAlg), ids=lambda a: a.label)
def test_save_and_load_round_trip_with_mode_0600(tmp_path, alg):
    keyring = Keyring.generate(alg)
    keyring.rotate(3600)
    path = tmp_path / "keys.json"
    keyring.save(path)
    assert mode_of(path) == 0o600
    assert not (tmp_path / "keys.json.tmp").exists()
    loaded = Keyring.load(path)
    assert loaded.to_json() == keyring.to_json()
    assert loaded.keys == keyring.keys
    assert loaded.active == keyring.active
    blob = sealed_by(keyring)
    assert open_sealed(blob, None, loaded).header.key_id == keyring.active.key_id
    assert open_sealed(sealed_by(loaded), None, keyring).header.key_id == keyring.active.key_id


def test_trust_store_file_round_trips_without_secrets(tmp_path):
    producer = Keyring.generate(SigAlg.ED25519)
    path = tmp_path / "trust.json"
    producer.trust_store().save(path)
    data = json.loads(path.read_text())
    assert data["active"] is None and all("secret" not in k for k in data["keys"])
    consumer = Keyring.load(path)
    assert open_sealed(sealed_by(producer), None, consumer).header.key_id == producer.active.key_id


def test_save_replaces_an_existing_file_and_keeps_mode_0600(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    Keyring.generate().save(path)
    assert mode_of(path) == 0o600
    assert json.loads(path.read_text())["format"] == KEYRING_FORMAT


def test_save_forces_mode_0600_over_a_leftover_tmp_file(tmp_path):
    # regression: O_CREAT does not change the mode of an existing file, so a leftover
    # world-readable keys.json.tmp made the saved key file world-readable too.
    path = tmp_path / "keys.json"
    leftover = tmp_path / "keys.json.tmp"
    leftover.write_text("partial write from a crash")
    os.chmod(leftover, 0o644)
    Keyring.generate().save(path)
    assert mode_of(path) == 0o600


def _valid_file() -> dict:
    keyring = Keyring.generate()
    keyring.add(SigningKey.generate(SigAlg.ED25519))
    return keyring.to_json()


def _ed_entry(data):
    return next(k for k in data["keys"] if k["alg"] == "ed25519")


def _hmac_entry(data):
    return next(k for k in data["keys"] if k["alg"] == "hmac-sha256")


MALFORMED = {
    "not a keyring": (lambda d: [d], "not a statetier keyring"),
    "other format": (lambda d: {**d, "format": "statetier-keyring/2"}, "statetier-keyring/1"),
    "entry without id": (lambda d: _hmac_entry(d).pop("id"), "malformed key entry"),
    "entry not an object": (lambda d: d["keys"].append(7), "malformed key entry"),
    "id not hex": (lambda d: _hmac_entry(d).update(id="zz" * 8), "malformed key entry"),
    "id too short": (lambda d: _hmac_entry(d).update(id="00" * 4), "8 bytes"),
    "unknown alg": (lambda d: _hmac_entry(d).update(alg="rsa"), "unknown key algorithm"),
    "secret not base64": (lambda d: _hmac_entry(d).update(secret="abc"), "malformed key entry"),
    "hmac without secret": (lambda d: _hmac_entry(d).pop("secret"), "at least 16 bytes"),
    "hmac short secret": (lambda d: _hmac_entry(d).update(secret=base64.b64encode(b"x" * 8).decode()),
                          "at least 16 bytes"),
    "ed25519 without public": (lambda d: _ed_entry(d).pop("public"), "32-byte public key"),
    "ed25519 short secret": (lambda d: _ed_entry(d).update(secret=base64.b64encode(b"x" * 31).decode()),
                             "32-byte seed"),
    "ed25519 foreign secret": (lambda d: _ed_entry(d).update(secret=base64.b64encode(b"y" * 32).decode()),
                               "matching its public key"),
    "created not int": (lambda d: _hmac_entry(d).update(created_at_ns="soon"), "malformed key entry"),
    "active not hex": (lambda d: d.update(active="active!"), "'active' must be a hex key id"),
    "active unknown": (lambda d: d.update(active="00" * 8), "not in the keyring"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_key_file_is_a_config_error_naming_the_problem(tmp_path, case):
    edit, words = MALFORMED[case]
    data = _valid_file()
    result = edit(data)
    if isinstance(result, (dict, list)):
        data = result
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        Keyring.load(path)
    assert type(info.value) is ConfigError
    assert words in str(info.value)


def test_ed25519_secret_not_matching_its_public_key_is_refused_at_load():
    # regression: a 31-byte or foreign Ed25519 seed loaded fine and failed only when the
    # daemon first signed (ValueError), or signed objects its own trust store refused.
    data = _valid_file()
    _ed_entry(data)["secret"] = base64.b64encode(b"z" * 32).decode()
    with pytest.raises(ConfigError, match="matching its public key"):
        Keyring.from_json(data)


def test_missing_key_file_says_how_to_create_one(tmp_path):
    with pytest.raises(ConfigError, match="statetier keygen"):
        Keyring.load(tmp_path / "absent.json")


def test_key_file_that_is_not_json_is_a_config_error(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text("{ not json")
    with pytest.raises(ConfigError, match="cannot read key file"):
        Keyring.load(path)


def test_key_file_that_is_a_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read key file"):
        Keyring.load(tmp_path)
