"""Prefill/decode handoff of one request's whole state, through Redis, for real geometries.

``run_pd(cluster, cases, reps, progress) -> rows`` (async). Per case (model, tokens), every
repetition does, in turn:

- raw: redis-py SET of the same bytes (2 MiB chunks, one pipeline per tensor), then GET of
  them, on the same redis-server; the best redis-py does on them (every chunk at once over
  ``BEST_CONNECTIONS`` concurrent pipelines, ``workload_raw.RedisRaw``); and copy + keyed
  BLAKE3 of the same bytes, one thread;
- handoff: ``put_many`` with ``publish=True`` on the prefill daemon (one KV record per
  attention layer covering ``[0, tokens)``, one SSM snapshot per SSM layer; each put returns
  once the object is in Redis), then on the decode daemon the joint-hit ``lookup``
  (``kv_layout="prefix"``, every layer, leased) and ``load_many`` of what it found, which
  reads Redis, verifies, promotes into the decode arena and copies out to the client.

The first repetition is a warm-up whose loaded bytes are compared with what was put;
each repetition uses a new prefix (nothing is cached on the decode side) and its objects
are deleted from both daemons afterwards, outside the timing.

Rows (``suite="pd"``, ``tier="redis"``): ``put+publish`` (raw ``redis-py SET``), ``lookup+load``
(raw ``redis-py GET``) and ``handoff`` (raw ``redis-py SET+GET``), each also against the
best raw (``redis-py ×4 SET`` …) and ``memcpy+blake3``; ``size_bytes`` is the whole state,
``batch`` its object count, ``lookup_ms`` the median time of the lookup alone, ``passes``
how many times each byte was copied and hashed, per side (``put``: client, prefill daemon;
``load``: decode daemon, client; ``protocol.passes``, the daemons' through
``statetier_payload_pass_bytes_total``), next to the raw paths' (``raw``).
"""

from __future__ import annotations

import os
import statistics
import time
import uuid

from statetier.launch import served_by_tier
from statetier.protocol.passes import PASSES, PassCount, Passes

from .workload_models import Model, request_state
from .workload_raw import BEST_CONNECTIONS, BEST_NAME, MemoryRaw, RedisRaw, atimed, byte_views, paired_row, timed

BLOCK_TOKENS = 256


def _namespace(model: Model):
    from statetier.protocol.identity import NamespaceSpec

    return NamespaceSpec(f"bench-pd/{model.name}", kv_block_size=BLOCK_TOKENS, kv_dtype=model.kv_dtype,
                         ssm_dtype=model.ssm_dtype, conv_dtype=model.conv_dtype)


class _Handoff:
    """One model's state moved from the prefill daemon to the decode daemon."""

    def __init__(self, prefill, decode, model: Model, state) -> None:
        self.prefill, self.decode, self.model, self.state = prefill, decode, model, state
        self.refs: list = []
        self.client_passes = {"put": PassCount(), "load": PassCount()}  # this process: the two clients

    def _items(self, prefix: bytes, request_id: str) -> list:
        from statetier.clients import PutItem

        kv = [PutItem(self.prefill.kv_key(layer, prefix, 0, self.state.tokens), tensors, request_id, publish=True)
              for layer, tensors in self.state.kv.items()]
        ssm = [PutItem(self.prefill.ssm_key(layer, prefix, self.state.tokens), tensors, request_id, publish=True)
               for layer, tensors in self.state.ssm.items()]
        return kv + ssm

    async def put(self, prefix: bytes) -> None:
        before = PASSES.snapshot()
        self.refs = await self.prefill.put_many(self._items(prefix, f"pd-{uuid.uuid4().hex[:12]}"))
        self.client_passes["put"] = _added(self.client_passes["put"], before)

    async def lookup_load(self, prefix: bytes, check: bool) -> float:
        """Returns the seconds the lookup alone took."""
        started = time.perf_counter()
        hit = await self.decode.lookup(self.model.attention_layers, self.model.ssm_layers,
                                       [(self.state.tokens, prefix)], kv_layout="prefix")
        lookup_s = time.perf_counter() - started
        try:
            if hit.tokens != self.state.tokens or len(hit.refs) != self.state.objects():
                raise RuntimeError(f"the decode daemon found {hit.tokens} of {self.state.tokens} tokens")
            before = PASSES.snapshot()
            loaded = await self.decode.load_many(hit.refs)
            self.client_passes["load"] = _added(self.client_passes["load"], before)
        finally:
            await self.decode.release(hit.lease_ids)
        if check:
            self._compare(hit.refs, loaded)
        return lookup_s

    def _compare(self, refs, loaded) -> None:
        import torch

        for ref, tensors in zip(refs, loaded):
            group = (self.state.kv if ref.key.kind.name == "KV" else self.state.ssm)[ref.key.layer]
            for name, tensor in group.items():
                if not torch.equal(tensors[name].view(torch.uint8), tensor.view(torch.uint8)):
                    raise RuntimeError(f"layer {ref.key.layer} {name}: the decode side got other bytes")

    async def delete(self) -> None:
        for client in (self.decode, self.prefill):
            for ref in self.refs:
                await client.delete(ref)
        self.refs = []


async def _measure_case(prefill, decode, redis_url: str, model: Model, tokens: int, reps: int,
                        progress) -> tuple[list[dict], dict[str, PassCount]]:
    state = request_state(model, tokens, seed=tokens)
    views = byte_views(state.tensors())
    memory, red, best = MemoryRaw(views), RedisRaw(redis_url), RedisRaw(redis_url, BEST_CONNECTIONS)
    handoff = _Handoff(prefill, decode, model, state)
    times: dict[str, list[float]] = {name: [] for name in ("set", "get", "mem", "put", "load", "lookup",
                                                           "best_set", "best_get")}
    try:
        for rep in range(reps + 1):  # repetition 0 warms up and checks the bytes
            t_set = await atimed(lambda: red.set_all(views))
            t_get = await atimed(red.get_all)
            await red.clear()
            t_best_set = await atimed(lambda: best.set_all(views))
            t_best_get = await atimed(best.get_all)
            await best.clear()
            t_mem = timed(memory.run)
            prefix = os.urandom(32)
            t_put = await atimed(lambda: handoff.put(prefix))
            started = time.perf_counter()
            t_lookup = await handoff.lookup_load(prefix, check=rep == 0)
            t_load = time.perf_counter() - started
            await handoff.delete()
            if rep:
                for name, value in zip(times, (t_set, t_get, t_mem, t_put, t_load, t_lookup, t_best_set, t_best_get)):
                    times[name].append(value)
            progress(1)
    finally:
        await handoff.delete()
        await red.close()
        await best.close()
    size, objects = state.nbytes(), state.objects()
    extra = {"model": model.display, "tokens": tokens, "case": f"{model.display} {tokens // 1024}k",
             "objects": objects, "reps": reps, "lookup_ms": statistics.median(times["lookup"]) * 1e3}
    handoff_t = [p + lo for p, lo in zip(times["put"], times["load"])]
    set_get = [s + g for s, g in zip(times["set"], times["get"])]
    best_set_get = [s + g for s, g in zip(times["best_set"], times["best_get"])]
    rows = []
    for op, measured, red_raw, best_raw, red_name in (
            ("put+publish", times["put"], times["set"], times["best_set"], "SET"),
            ("lookup+load", times["load"], times["get"], times["best_get"], "GET"),
            ("handoff", handoff_t, set_get, best_set_get, "SET+GET")):
        rows.append(paired_row("pd", "redis", op, size, objects, measured, f"redis-py {red_name}", red_raw, **extra))
        rows.append(paired_row("pd", "redis", op, size, objects, measured, f"{BEST_NAME} {red_name}", best_raw,
                               **extra))
        rows.append(paired_row("pd", "redis", op, size, objects, measured, "memcpy+blake3", times["mem"], **extra))
    return rows, handoff.client_passes


async def run_pd(cluster, cases: list[tuple[Model, int]], reps: int, progress) -> list[dict]:
    from statetier.clients import AsyncClient

    rows: list[dict] = []
    for model, tokens in cases:
        namespace = _namespace(model)
        before = cluster.decode.counters()
        daemons_before = _daemon_passes(cluster.prefill), _daemon_passes(cluster.decode)
        async with AsyncClient(cluster.prefill.url, namespace=namespace) as prefill, \
                AsyncClient(cluster.decode.url, namespace=namespace) as decode:
            case_rows, clients = await _measure_case(prefill, decode, cluster.redis_url, model, tokens, reps,
                                                     progress)
        served = served_by_tier(before, cluster.decode.counters())
        nbytes = request_state(model, tokens, seed=tokens).nbytes() * (reps + 1)  # the warm-up moved them too
        passes = {
            "put": {"client": Passes.per_byte(PassCount(), clients["put"], nbytes),
                    "daemon": Passes.per_byte(daemons_before[0], _daemon_passes(cluster.prefill), nbytes)},
            "load": {"daemon": Passes.per_byte(daemons_before[1], _daemon_passes(cluster.decode), nbytes),
                     "client": Passes.per_byte(PassCount(), clients["load"], nbytes)},
            "raw": RAW_PASSES,
        }
        rows += [{**row, "served_by_tier": served, "passes": passes} for row in case_rows]
    return rows


#: (copies, hashes) per byte of the raw paths: redis-py moves bytes between sockets and
#: ``bytes`` objects only (the transfer, not counted here); the memory raw copies and hashes once.
RAW_PASSES = {"redis-py SET+GET": (0.0, 0.0), "memcpy+blake3": (1.0, 1.0)}


def _daemon_passes(daemon) -> PassCount:
    """What ``statetier_payload_pass_bytes_total`` says the daemon process copied and hashed."""
    samples = daemon.scrape()
    return PassCount(int(samples.value("statetier_payload_pass_bytes_total", op="copied")),
                     int(samples.value("statetier_payload_pass_bytes_total", op="hashed")))


def _added(total: PassCount, before: PassCount) -> PassCount:
    after = PASSES.snapshot()
    return PassCount(total.copied + after.copied - before.copied, total.hashed + after.hashed - before.hashed)
