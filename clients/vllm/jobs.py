"""What the connector's scheduler side tells its workers each step, and the PD handoff.

- ``LoadItem`` / ``LoadJob`` — one object to load (the *expected* ``StateRef``: this engine's
  namespace and its own prefix hash, the found state id and version) into one block or
  Mamba slot of a KV cache group (``group``: its index): a group object fills that block of
  every layer of the group, a per-layer object (saved before group objects) one layer's;
  a job is one request's whole restore, all groups and TP shards.
- ``SaveItem`` / ``SaveJob`` — one group object to seal under a group key: one block of every
  attention layer of a group, or every Mamba layer's slot of a group at a boundary (the
  worker puts its TP rank in as the shard; a replicated Mamba group's state is saved by rank
  0 alone, as shard 0).
- ``StepMeta`` — the loads and saves of one engine step, and the requests vLLM preempted
  in it (their saves are flushed before their blocks are reused). Plain picklable values:
  vLLM sends them to worker processes.
- ``handoff_params(tokens, block_size, refs, *, keys, saved)`` / ``handoff_from_params(params)`` →
  ``Handoff`` — the ``kv_transfer_params`` a producer returns for a finished request
  (``{"statetier": {"tokens", "block_size", "refs", "keys", "saved"}}``, JSON) and their parsing
  on the consumer: ``keys`` names the request's extra keys (``extra_keys.RequestKeys.digests``:
  a consumer of another salt, adapter or image refuses the handoff by that name), ``saved`` the
  boundary the producer saved up to (its refs may cover less: then the consumer looks the rest
  up). Both are optional on parsing (a handoff of an earlier producer: no extra keys, ``saved``
  = ``tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.identity import StateKey, StateRef
from statetier.protocol.messages import ref_from_wire, ref_to_wire

HANDOFF_KEY = "statetier"


@dataclass(frozen=True)
class LoadItem:
    group: int          # the KV cache group (vLLM's index) whose block or slot it fills
    ref: StateRef       # what the load must find: identity, state id, version
    block_id: int       # attention: the block of the page; Mamba: the request's state slot


@dataclass(frozen=True)
class LoadJob:
    request_id: str
    tokens: int                     # the boundary restored: every layer at exactly this many tokens
    items: tuple[LoadItem, ...]
    attention_blocks: tuple[int, ...]  # the blocks written, reported back if the load is refused
    problem: str = ""                  # set: the scheduler found the job unsound; the worker refuses it


@dataclass(frozen=True)
class SaveItem:
    group: int          # the KV cache group: every layer of it is in the object
    key: StateKey       # a group key (``LayerGroup.key``)
    block_id: int


@dataclass(frozen=True)
class SaveJob:
    request_id: str
    step: int          # tokens the request has absorbed after this step
    items: tuple[SaveItem, ...]


@dataclass(frozen=True)
class StepMeta:
    loads: tuple[LoadJob, ...] = ()
    saves: tuple[SaveJob, ...] = ()
    preempted: tuple[str, ...] = ()


@dataclass(frozen=True)
class Handoff:
    tokens: int
    block_size: int
    refs: tuple[StateRef, ...] = field(default_factory=tuple)
    keys: Mapping[str, str] = field(default_factory=dict)  # extra_keys.RequestKeys.digests of the producer's request
    saved: int = 0                                        # the boundary saves were scheduled to; 0: ``tokens``


def handoff_params(tokens: int, block_size: int, refs, *, keys: Mapping[str, str] | None = None,
                   saved: int | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` for a consumer: the refs of a joint hit at ``tokens``."""
    return {HANDOFF_KEY: {"tokens": int(tokens), "block_size": int(block_size),
                          "refs": [ref_to_wire(ref) for ref in refs], "keys": dict(keys or {}),
                          "saved": int(tokens if saved is None else saved)}}


def handoff_from_params(params: Mapping[str, Any] | None) -> Handoff | None:
    """The handoff in a request's ``kv_transfer_params``, ``None`` when it carries none.

    A malformed one raises ``InvalidRequest``: a consumer must not guess at a handoff.
    """
    if not params or HANDOFF_KEY not in params:
        return None
    raw = params[HANDOFF_KEY]
    try:
        refs = tuple(ref_from_wire(item) for item in raw["refs"])
        tokens, block_size, saved = raw["tokens"], raw["block_size"], raw.get("saved", raw["tokens"])
        keys = dict(raw.get("keys") or {})
    except (KeyError, TypeError, ValueError, AttributeError, StatetierError) as exc:
        raise InvalidRequest(f"kv_transfer_params[{HANDOFF_KEY!r}] is not a statetier handoff: {exc}") from exc
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (tokens, block_size, saved)):
        raise InvalidRequest("a statetier handoff needs positive integer tokens, block_size and saved")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise InvalidRequest("a statetier handoff's keys are names and digests (strings)")
    return Handoff(tokens, block_size, refs, keys, saved)
