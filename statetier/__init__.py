"""statetier: tiered offload of KV pages and SSM snapshots with signed, verified objects.

Subpackages (DESIGN §9; dependencies flow one way, left to right):

- ``statetier.protocol`` — identity, the sealed-object format, keys, errors, frame codec (sans-I/O)
- ``statetier.tiers``    — device, host (shared memory), disk (segments + LMDB) and Redis tiers
- ``statetier.daemon``   — the asyncio sidecar: composition root, server, config, metrics, CLI
- ``statetier.clients``  — the async and sync client SDK; depends on ``protocol`` only

Installed, the subpackages sit inside this folder. In a source checkout they live at the
repository root (``protocol/``, ``tiers/`` …), and this file points the package there.
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "protocol" / "__init__.py").is_file():
    __path__.append(str(_checkout))
