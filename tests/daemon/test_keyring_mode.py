"""A keyring file that group or others can read is said at start (issue 41 item 7).

The keyring signs every object and authenticates the peers: docs/operations.md §6 says
0600. Regression: a 0644 keyring was accepted silently. It is still used (refusing would
take a fleet down over a mode), with one warning that names the file and its mode.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from statetier.daemon.app import load_or_create_keyring
from statetier.daemon.config_loading import load_config
from statetier.protocol.keyring import Keyring


def keyring_at(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "keyring.json"
    Keyring.generate().save(path)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_keyring_group_or_others_can_read_is_used_with_a_warning(tmp_path: Path, mode: int, caplog) -> None:
    path = keyring_at(tmp_path, mode)
    config = load_config(None, env={}, overrides={"keys.keyring_file": str(path), "disk.directory": str(tmp_path)})
    with caplog.at_level(logging.WARNING, logger="statetier"):
        keyring, new_path = load_or_create_keyring(config)
    assert new_path is None and keyring.active is not None
    (warning,) = [r for r in caplog.records if "keys.keyring_file" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert f"{path} has mode {mode:04o}: group or others can read" in warning.getMessage()


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_keyring_only_its_owner_reads_is_used_silently(tmp_path: Path, mode: int, caplog) -> None:
    path = keyring_at(tmp_path, mode)
    config = load_config(None, env={}, overrides={"keys.keyring_file": str(path), "disk.directory": str(tmp_path)})
    with caplog.at_level(logging.WARNING, logger="statetier"):
        load_or_create_keyring(config)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
