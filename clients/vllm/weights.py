"""The identity of the weights a vLLM engine serves, derived without loading them; no vLLM.

New weights at the same path (a fine-tune, a re-quantization) must not be served the old
weights' state as verified: the connector mixes this identity into its namespace.

- ``weights_identity(model, revision="", *, hub_cache=None)`` → ``WeightsIdentity(value,
  source)`` or ``None``:
  - ``model`` a local directory holding weight files: ``files:<BLAKE2b-256>`` over, per file
    (sorted by name), its name, its size, its safetensors header (the 8-byte little-endian
    length and the JSON after it: tensor names, dtypes, shapes, offsets, ``__metadata__``) and
    ``SAMPLES`` slices of ``SAMPLE_BYTES`` spread evenly over its data; without safetensors
    files, each ``*.bin``/``*.pt``/``*.pth``/``*.gguf`` file is hashed whole. The same weights give the same identity on
    every node, wherever they lie; new values of the same shapes change the samples.
  - ``model`` a hub id: the commit the local Hugging Face cache resolves ``revision`` (default
    ``main``) to, ``hub:<commit>``; a 40-hex ``revision`` is the commit itself.
- ``resolve_fingerprint(cfg, model, revision, *, hub_cache=None)`` → the connector's weights
  fingerprint: ``cfg.model_fingerprint`` when set, else the derived identity; without either,
  ``InvalidRequest`` unless ``cfg.allow_unidentified_weights``. Logs what it chose.

A sample-based digest sees any retraining (every matrix changes) but not an edit confined to
bytes between samples: give ``model_fingerprint`` (a digest of the files, a registry tag)
where that matters. Called by ``connector.namespace_from_vllm``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from statetier.protocol.errors import InvalidRequest

from .layout import ConnectorConfig

log = logging.getLogger("vllm.statetier")  # the connector's logger: shown with vLLM's own lines

SAMPLES = 16
SAMPLE_BYTES = 64 << 10
MAX_HEADER_BYTES = 100 << 20  # what the safetensors format itself allows
_WHOLE_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class WeightsIdentity:
    value: str   # what enters the namespace: "files:<hex>" or "hub:<commit>"
    source: str  # where it came from, for the log


def weights_identity(model: str, revision: str = "", *, hub_cache: Path | None = None) -> WeightsIdentity | None:
    path = Path(model)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and _is_weight_file(p))
        if any(f.suffix == ".safetensors" for f in files):  # what vLLM loads when both are there
            files = [f for f in files if f.suffix == ".safetensors"]
        if not files:
            return None
        digest = hashlib.blake2b(b"statetier/weights/1", digest_size=32)
        for file in files:
            _digest_file(digest, file)
        names = ", ".join(f.name for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return WeightsIdentity(f"files:{digest.hexdigest()}", f"{len(files)} weight files in {path} ({names})")
    commit = _hub_commit(model, revision, hub_cache or _default_hub_cache())
    if commit is None:
        return None
    return WeightsIdentity(f"hub:{commit}", f"hub commit of {model}@{revision or 'main'}")


def resolve_fingerprint(cfg: ConnectorConfig, model: str, revision: str = "", *,
                        hub_cache: Path | None = None) -> str:
    if cfg.model_fingerprint:
        log.info("statetier connector: weights identity %s (model_fingerprint)", cfg.model_fingerprint)
        return cfg.model_fingerprint
    found = weights_identity(model, revision, hub_cache=hub_cache)
    if found is not None:
        log.info("statetier connector: weights identity %s (%s)", found.value, found.source)
        return found.value
    if cfg.allow_unidentified_weights:
        log.warning("statetier connector: no weights identity for %s (no weight files there, no hub commit in the "
                    "local cache); allow_unidentified_weights is set, so other weights served under this model name "
                    "and config would share its state", model)
        return ""
    raise InvalidRequest(f"kv_connector_extra_config: cannot tell which weights {model!r} are (no weight files in "
                         f"a local directory, no hub commit in the local cache): set 'model_fingerprint' (a hub "
                         f"commit, a digest of the weight files), or 'allow_unidentified_weights': true to run "
                         f"without one")


def _is_weight_file(path: Path) -> bool:
    return path.suffix == ".safetensors" or path.suffix in _WHOLE_FILE_SUFFIXES


def _digest_file(digest, path: Path) -> None:
    size = path.stat().st_size
    digest.update(struct.pack("<HQ", len(path.name.encode()), size) + path.name.encode())
    with path.open("rb") as handle:
        if path.suffix != ".safetensors":
            while chunk := handle.read(8 << 20):
                digest.update(chunk)
            return
        header_len = _safetensors_header_len(handle, path, size)
        digest.update(handle.read(header_len))
        data_start, data_len = 8 + header_len, size - 8 - header_len
        step = max(SAMPLE_BYTES, data_len // SAMPLES)
        for offset in range(data_start, size, step):
            handle.seek(offset)
            digest.update(handle.read(SAMPLE_BYTES))


def _safetensors_header_len(handle, path: Path, size: int) -> int:
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise InvalidRequest(f"{path}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        raise InvalidRequest(f"{path}: not a safetensors file (header length {header_len})")
    start = handle.tell()
    try:
        json.loads(handle.read(header_len))
    except ValueError as exc:
        raise InvalidRequest(f"{path}: not a safetensors file ({exc})") from None
    handle.seek(start)
    return header_len


def _default_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def _hub_commit(model: str, revision: str, hub_cache: Path) -> str | None:
    if _COMMIT.fullmatch(revision or ""):
        return revision
    if model.count("/") != 1 or model.startswith(("/", ".")):
        return None
    ref = hub_cache / f"models--{model.replace('/', '--')}" / "refs" / (revision or "main")
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT.fullmatch(commit) else None
