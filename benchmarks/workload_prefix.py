"""Multi-turn prefix reuse: conversations that grow turn by turn, restored by joint hits.

``run_prefix(daemon, plan, directory, progress) -> (rows, turns)`` (async), against one
daemon (host arena + disk + Redis; the arena smaller than the conversations' working set,
so older turns are evicted to disk and come back from there).
``run_prefix_across(prefill, decode, plan, directory, progress)`` (async): the same
conversations across two daemons with their peer tiers on, turns alternating between them
(every save published: descriptors in the directory, bytes kept by the daemon that served
the turn), so each turn restores the conversation's previous turn from the other daemon's
memory over the peer transport (``suite="prefix-peers"``, ``tier="peer"``; one more raw,
``socket+blake3``: the loaded bytes over a plain loopback socket, hashed on receipt). Jamba-mini geometry;
every conversation starts with the same system prompt. Conversations take turns round
robin; each turn

1. looks up the longest restorable prefix: boundaries at every 256-token block end of the
   new context, ``kv_layout="blocks"``, every attention and SSM layer (a joint hit);
2. loads what the lookup leased (KV pages of every block up to the hit, SSM snapshots
   at the hit) with ``load_many``;
3. "prefills" the rest (synthetic tensors) and saves it: the KV pages of the new blocks
   and an SSM snapshot at the new end (turn 0 also at the end of the system prompt, so
   that other conversations can restore it).

Tokens possible for a turn: the length this conversation saved last (or, on its first
turn, the system prompt when another conversation saved it). Hit rate = tokens restored
÷ tokens possible, over all turns. Each turn is paired with raw limits on the same bytes:
copy + keyed BLAKE3 of what was loaded and of what was saved, and ``pwrite`` +
``fdatasync`` of what was saved (under ``directory``).

Rows (``suite="prefix"``, ``tier="host+disk"``): ``lookup+load`` against ``memcpy+blake3``
and against the limit of the tier that served each byte (``served tier, cache warm`` /
``cold``: memcpy+BLAKE3 for the bytes the host served, ``pread`` + BLAKE3 of the same bytes
from a file, its pages cached or dropped first, for the bytes the disk served; which tier
served which bytes comes from the daemon's ``statetier_hits_total`` per tier and kind, read
around each load); ``save`` against ``memcpy+blake3`` and ``write+fdatasync``. GB/s are total bytes ÷ total
time; ``ratio`` is total raw time ÷ total time; p50/p99 over the turns; extra fields
``hit_rate``, ``tokens_restored``, ``tokens_possible``, the daemon's ``hits_by_tier`` and
``lookup_ms`` (median over the turns of the lookup alone), ``disk_fraction`` (of the loaded
bytes), ``pread_blake3_warm_gbps`` / ``pread_blake3_cold_gbps``.
``turns`` lists every turn (conversation, turn, context, possible, restored, bytes, times).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

from statetier.launch import served_by_tier

from .workload_models import by_name, kv_block, ssm_snapshot
from .workload_raw import FileRaw, MemoryRaw, ReadRaw, byte_views, timed

BLOCK = 256
MODEL = by_name("jamba-mini")
POOL = 12  # distinct KV pages cycled through (every object still gets its own key)


@dataclass(frozen=True)
class PrefixPlan:
    conversations: int
    turns: int
    system_blocks: int
    new_blocks: tuple[int, int]  # blocks each turn adds, drawn uniformly from [lo, hi]


@dataclass
class Turn:
    conversation: int
    turn: int
    context: int
    possible: int
    restored: int
    loaded_bytes: int = 0
    saved_bytes: int = 0
    lookup_s: float = 0.0
    load_s: float = 0.0
    save_s: float = 0.0
    raw_load_s: float = 0.0
    raw_read_warm_s: float = 0.0  # pread + BLAKE3 of the loaded bytes, page cache warm
    raw_read_cold_s: float = 0.0  # the same with the file's pages dropped first
    loaded_by_tier: dict = field(default_factory=dict)  # bytes each tier served (from its hits)
    raw_save_s: float = 0.0
    raw_write_s: float = 0.0
    raw_socket_s: float = 0.0  # the loaded bytes over a loopback socket + BLAKE3 (the peer workload)


@dataclass
class _Conversation:
    index: int
    tokens: list[int]
    saved: int = 0  # tokens covered by its last saved snapshot
    turns: list = field(default_factory=list)


class _Pools:
    """Synthetic tensors: a few KV pages and SSM snapshot sets, reused under many keys."""

    def __init__(self) -> None:
        import torch

        generator = torch.Generator().manual_seed(11)
        self.pages = [kv_block(MODEL, BLOCK, generator) for _ in range(POOL)]
        self.snapshots = [ssm_snapshot(MODEL, generator) for _ in range(2)]
        self._next = 0

    def page(self) -> dict:
        self._next += 1
        return self.pages[self._next % POOL]


def _nbytes(groups) -> int:
    return sum(t.numel() * t.element_size() for group in groups for t in group.values())


def hits_by_tier_and_kind(daemon) -> dict[tuple[str, str], int]:
    """Loads served so far by each tier, per kind (``kv``, ``ssm``): one metrics scrape."""
    out: dict[tuple[str, str], int] = {}
    for labels, value in daemon.scrape().matching("statetier_hits_total").items():
        named = dict(labels)
        key = (named["tier"], named["kind"])  # both labels of every hits sample
        out[key] = out.get(key, 0) + int(value)
    return out


class _Runner:
    """Turns against ``nodes`` (``(client, daemon)`` pairs): turn ``i`` of every conversation on
    node ``i % len(nodes)``; with ``publish`` every save is published (the peer workload)."""

    def __init__(self, nodes: list, plan: PrefixPlan, directory, publish: bool = False) -> None:
        from statetier.protocol.identity import prefix_hashes

        self.nodes, self.plan, self.publish = nodes, plan, publish
        self.pools, self.file, self.reads = _Pools(), FileRaw(directory), ReadRaw(directory)
        self.hashes = prefix_hashes
        self.system_saved = False

    def boundaries(self, tokens: list[int]) -> list[tuple[int, bytes]]:
        return [((i + 1) * BLOCK, h) for i, h in enumerate(self.hashes(tokens, BLOCK))]

    async def turn(self, conv: _Conversation, index: int) -> Turn:
        from statetier.clients import PutItem

        (client, daemon), plan = self.nodes[index % len(self.nodes)], self.plan
        possible = conv.saved or (plan.system_blocks * BLOCK if self.system_saved else 0)
        bounds = self.boundaries(conv.tokens)
        hits_before = hits_by_tier_and_kind(daemon)
        started = time.perf_counter()
        hit = await client.lookup(MODEL.attention_layers, MODEL.ssm_layers, bounds, kv_layout="blocks")
        lookup_s = time.perf_counter() - started
        try:
            loaded = await client.load_many(hit.refs) if hit.tokens else []
        finally:
            await client.release(hit.lease_ids)
        load_s = time.perf_counter() - started
        record = Turn(conv.index, index, len(conv.tokens), possible, hit.tokens, _nbytes(loaded),
                      lookup_s=lookup_s, load_s=load_s)
        record.loaded_by_tier = _bytes_by_tier(hits_before, hits_by_tier_and_kind(daemon), hit.refs, loaded)
        items, groups = [], []
        request = f"chat-{conv.index}-{index}"
        for block in range(hit.tokens // BLOCK, len(bounds)):
            end, prefix = bounds[block]
            for layer in MODEL.attention_layers:
                page = self.pools.page()
                items.append(PutItem(client.kv_key(layer, prefix, end - BLOCK, end), page, request,
                                     publish=self.publish))
                groups.append(page)
        ends = [len(conv.tokens)]
        if not self.system_saved and hit.tokens < plan.system_blocks * BLOCK:
            ends.append(plan.system_blocks * BLOCK)
        for end in ends:
            snapshot = self.pools.snapshots[end % 2]
            for layer in MODEL.ssm_layers:
                items.append(PutItem(client.ssm_key(layer, bounds[end // BLOCK - 1][1], end), snapshot, request,
                                     publish=self.publish))
                groups.append(snapshot)
        started = time.perf_counter()
        await client.put_many(items)
        record.save_s = time.perf_counter() - started
        record.saved_bytes = _nbytes(groups)
        self.system_saved = True
        conv.saved = len(conv.tokens)
        self._pair_raw(record, loaded, groups)
        return record

    def _pair_raw(self, record: Turn, loaded: list[dict], saved: list[dict]) -> None:
        loaded_views = byte_views([t for group in loaded for t in group.values()])
        saved_views = byte_views([t for group in saved for t in group.values()])
        record.raw_load_s = timed(MemoryRaw(loaded_views).run) if loaded_views else 0.0
        if loaded_views and self.publish:
            from .workload_peers import SocketRaw

            record.raw_socket_s = timed(SocketRaw(loaded_views).run)
        if loaded_views:
            self.reads.stage(loaded_views)
            record.raw_read_warm_s = timed(self.reads.run_warm)
            record.raw_read_cold_s = self.reads.run_cold()
        record.raw_save_s = timed(MemoryRaw(saved_views).run)
        record.raw_write_s = timed(lambda: self.file.write_sync(saved_views))
        self.file.reset()


def _bytes_by_tier(before: dict, after: dict, refs, loaded: list[dict]) -> dict[str, int]:
    """Bytes each tier served in one load: its hits per kind times that kind's object size
    (every object of one kind has one size in this workload)."""
    size_of: dict[str, int] = {}
    for ref, group in zip(refs, loaded):
        size_of[ref.key.kind.name.lower()] = _nbytes([group])
    out: dict[str, int] = {}
    for (tier, kind), hits in after.items():
        served = hits - before.get((tier, kind), 0)
        if served and kind in size_of:
            out[tier] = out.get(tier, 0) + served * size_of[kind]
    return out


def _served_raw_s(turn: Turn, read_s: float) -> float:
    """The raw time of a turn's load against the limit of the tier that served each byte:
    memcpy+BLAKE3 for memory tiers, ``read_s`` (pread+BLAKE3) for the disk tier."""
    disk = turn.loaded_by_tier.get("disk", 0) / turn.loaded_bytes
    return turn.raw_load_s * (1 - disk) + read_s * disk


def _conversations(plan: PrefixPlan) -> list[_Conversation]:
    rng = random.Random(5)
    system = [rng.randrange(1, 150_000) for _ in range(plan.system_blocks * BLOCK)]
    return [_Conversation(i, list(system)) for i in range(plan.conversations)]


def _grow(conv: _Conversation, plan: PrefixPlan, rng: random.Random) -> None:
    """The previous reply and the new user message: whole blocks of fresh tokens."""
    conv.tokens += [rng.randrange(1, 150_000) for _ in range(rng.randint(*plan.new_blocks) * BLOCK)]


async def run_prefix(daemon, plan: PrefixPlan, directory, progress) -> tuple[list[dict], list[dict]]:
    turns, hits = await _converse([daemon], plan, directory, progress, publish=False)
    return _rows(turns, plan, hits), [asdict(turn) for turn in turns]


async def run_prefix_across(prefill, decode, plan: PrefixPlan, directory, progress) -> tuple[list[dict], list[dict]]:
    """The conversations across two daemons with peer tiers: each turn on the other daemon."""
    turns, hits = await _converse([prefill, decode], plan, directory, progress, publish=True)
    return _rows(turns, plan, hits, suite="prefix-peers", tier="peer"), [asdict(turn) for turn in turns]


async def _converse(daemons: list, plan: PrefixPlan, directory, progress, publish: bool) -> tuple[list[Turn], dict]:
    from contextlib import AsyncExitStack

    from statetier.clients import AsyncClient
    from statetier.protocol.identity import NamespaceSpec

    namespace = NamespaceSpec("bench-prefix/jamba-mini", kv_block_size=BLOCK, kv_dtype="bfloat16")
    rng = random.Random(7)
    conversations = _conversations(plan)
    before = [daemon.counters() for daemon in daemons]
    turns: list[Turn] = []
    async with AsyncExitStack() as stack:
        nodes = [(await stack.enter_async_context(AsyncClient(d.url, namespace=namespace)), d) for d in daemons]
        runner = _Runner(nodes, plan, directory, publish)
        try:
            for index in range(plan.turns):
                for conv in conversations:
                    _grow(conv, plan, rng)
                    turns.append(await runner.turn(conv, index))
                    progress(1)
        finally:
            runner.file.close()
            runner.reads.close()
    hits: dict[str, int] = {}
    for daemon, counted in zip(daemons, before):
        for tier, n in served_by_tier(counted, daemon.counters()).items():
            hits[tier] = hits.get(tier, 0) + n
    return turns, hits


def _rows(turns: list[Turn], plan: PrefixPlan, hits: dict, suite: str = "prefix",
          tier: str = "host+disk") -> list[dict]:
    from .rows import percentile

    possible = sum(t.possible for t in turns)
    restored = sum(min(t.restored, t.possible) for t in turns)
    extra = {"model": MODEL.display, "conversations": plan.conversations, "turns": plan.turns,
             "tokens_possible": possible, "tokens_restored": restored,
             "tokens_beyond_possible": sum(max(0, t.restored - t.possible) for t in turns),
             "hit_rate": restored / possible if possible else None, "hits_by_tier": hits, "metric": "throughput"}
    loads = [t for t in turns if t.loaded_bytes]
    rows = []

    def row(op: str, chosen: list[Turn], size_of, time_of, raw: str, raw_of, **more) -> dict:
        size = sum(size_of(t) for t in chosen)
        spent, raw_spent = sum(time_of(t) for t in chosen), sum(raw_of(t) for t in chosen)
        per_turn = [time_of(t) for t in chosen]
        return {"suite": suite, "tier": tier, "op": op, "size_bytes": size, "batch": len(chosen),
                "gbps": size / spent / 1e9, "raw": raw, "raw_gbps": size / raw_spent / 1e9,
                "ratio": raw_spent / spent, "p50_us": percentile(per_turn, 50) * 1e6,
                "p99_us": percentile(per_turn, 99) * 1e6, "samples": len(chosen),
                "lookup_ms": percentile([t.lookup_s for t in chosen], 50) * 1e3, **extra, **more}

    if loads:
        rows.append(row("lookup+load", loads, lambda t: t.loaded_bytes, lambda t: t.load_s, "memcpy+blake3",
                        lambda t: t.raw_load_s))
        if all(t.raw_socket_s for t in loads):  # the peer workload: the bytes crossed a socket
            rows.append(row("lookup+load", loads, lambda t: t.loaded_bytes, lambda t: t.load_s, "socket+blake3",
                            lambda t: t.raw_socket_s))
        loaded = sum(t.loaded_bytes for t in loads)
        limits = {"disk_fraction": sum(t.loaded_by_tier.get("disk", 0) for t in loads) / loaded,
                  "pread_blake3_warm_gbps": loaded / sum(t.raw_read_warm_s for t in loads) / 1e9,
                  "pread_blake3_cold_gbps": loaded / sum(t.raw_read_cold_s for t in loads) / 1e9}
        rows.append(row("lookup+load", loads, lambda t: t.loaded_bytes, lambda t: t.load_s,
                        "served tier, cache warm", lambda t: _served_raw_s(t, t.raw_read_warm_s), **limits))
        rows.append(row("lookup+load", loads, lambda t: t.loaded_bytes, lambda t: t.load_s,
                        "served tier, cache cold", lambda t: _served_raw_s(t, t.raw_read_cold_s), **limits))
    rows.append(row("save", turns, lambda t: t.saved_bytes, lambda t: t.save_s, "memcpy+blake3",
                    lambda t: t.raw_save_s))
    rows.append(row("save", turns, lambda t: t.saved_bytes, lambda t: t.save_s, "write+fdatasync",
                    lambda t: t.raw_write_s))
    return rows
