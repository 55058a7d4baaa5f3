"""The composition root: the one place that builds concrete tiers and wires the daemon.

- ``build(config) -> App``  — keyring, tiers (device, host, disk, redis as configured),
                              version registry (with Redis: kept answering through an
                              outage, and its health probe ``daemon.redis_watch``), metrics,
                              the KV event publisher (``[events]``) and the engine's
                              announcements into it, engine, server, metrics HTTP.
- ``App.start()`` → ``App.serve_until(stop)`` → ``App.shutdown()`` — three awaited phases:
  start tiers, listen; serve; stop accepting, finish or cancel in-flight requests within
  the grace period, flush write-behind, close tiers in reverse order.
- ``run(config) -> int``     — ``statetier serve``: uvloop, signal handling (the first
                              SIGTERM/SIGINT stops gracefully, a second exits at once).

Keys: the signing keyring is read from ``keys.keyring_file`` (default
``<disk dir>/keyring.json``), generated with mode 0600 on first start (saved once the start
succeeded: a start that fails leaves none behind) — with a warning, or
a refusal (``keys.new_keyring_with_redis``), when a Redis tier is configured: daemons that
share Redis must share one keyring. The at-rest key likewise when a tier encrypts.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import errno
import gc
import json
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from statetier.protocol.errors import ConfigError, StatetierError, Unavailable
from statetier.protocol.keyring import Keyring
from statetier.tiers.base import PurgeMarkStore, Tier
from statetier.tiers.crypto import AtRestCipher
from statetier.tiers.registry import MemoryVersionRegistry, VersionRegistry
from statetier.tiers.tolerant_registry import TolerantRegistry

from .config import Config
from .engine import Announcements, Engine, EngineOptions, Publishing
from .events import EventPublisher
from .http import MetricsServer, Readiness
from .metrics import Metrics
from .peer_address import PeerAddress, joined, resolve_peer_address
from .redis_watch import RedisWatch
from .server import Server

log = logging.getLogger("statetier")


@dataclass
class App:
    config: Config
    engine: Engine
    server: Server
    metrics: Metrics
    http: MetricsServer | None
    executor: ThreadPoolExecutor
    events: EventPublisher | None = None
    watch: RedisWatch | None = None
    new_keyring: tuple[Keyring, Path] | None = None  # generated here: saved once started
    peer_address: PeerAddress | None = None  # peers.enabled: where it listens, what it advertises
    maintenance: list[asyncio.Task] = field(default_factory=list)

    async def start(self) -> None:
        try:
            await self.engine.start()
        except Unavailable as exc:
            if self.config.redis.url is None:
                raise
            from statetier.tiers.redis.connect import redact

            raise Unavailable(f"redis.url {redact(self.config.redis.url)!r} did not answer at start and "
                              f"redis.start_unreachable = \"refuse\": {exc.message}") from exc
        except OSError as exc:  # the one listener a tier opens: the peer tier's
            if self.peer_address is None or exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise
            where = joined(self.peer_address.host, self.peer_address.port)
            raise ConfigError(f"peers.listen: cannot listen on {where} ({self.peer_address.note}): {exc}; another "
                              f"daemon on this host? Give each its own port (peers.listen = \"0.0.0.0:PORT\")") from exc
        if self.watch is not None:
            await self.watch.check()  # redis_up and /readyz true from the first scrape
        try:
            if self.events is not None:
                self.events.start()
            await self.server.start()
            if self.http is not None:
                await self.http.start()
        except BaseException:
            await self.server.shutdown(0)  # removes the socket file it bound, if it got that far
            await self.engine.close()
            if self.events is not None:
                self.events.close()
            raise
        if self.watch is not None:
            self.maintenance.append(asyncio.create_task(self.watch.run(), name="redis-health"))
        self.maintenance.append(asyncio.create_task(self._maintain(), name="maintenance"))
        if self.new_keyring is not None:
            save_new_keyring(*self.new_keyring, shared=self.config.redis.url is not None)
            self.new_keyring = None

    async def serve_until(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def shutdown(self) -> None:
        for task in self.maintenance:
            task.cancel()
        await asyncio.gather(*self.maintenance, return_exceptions=True)
        await self.server.shutdown(self.config.limits.shutdown_grace_seconds)
        if self.http is not None:
            await self.http.close()
        await self.engine.close(self.config.limits.shutdown_grace_seconds)
        if self.events is not None:
            self.events.close()
        self.executor.shutdown(wait=True)

    async def _maintain(self) -> None:
        """Compaction passes and lease expiry; the tiers never move leased bytes."""
        interval = self.config.disk.compact_interval_seconds
        while True:
            await asyncio.sleep(interval)
            for tier in self.engine.tiers:
                try:
                    await tier.compact()
                except StatetierError as exc:
                    log.warning("compaction of %s failed: %s", tier.name, exc)

    def describe(self) -> str:
        lines = [f"statetier listening on unix://{Path(self.config.listen.socket_path).resolve()}"]
        if self.config.listen.tcp:
            lines.append(f"  tcp: {self.config.listen.tcp}{' (TLS)' if self.config.listen.tls_cert else ''}")
        if self.http is not None:
            lines.append(f"  metrics: http://{self.config.metrics.host}:{self.http.port}/metrics")
        for stats in self.engine.tier_stats():
            sized = ""
            if stats.tier == "host" and self.config.host.capacity_bytes is None:
                sized = (" (25% of this machine's available memory, allocated now; host.capacity_bytes or "
                         "--host-capacity sets it)")
            if stats.capacity == 0 and stats.tier == "redis" and self.config.redis.url is not None:
                capacity = "unbounded (redis.capacity_bytes unset: Redis's TTL and maxmemory bound it)"
            else:
                capacity = f"{stats.capacity} bytes ({_gib(stats.capacity)})"
            lines.append(f"  tier {stats.tier}: capacity {capacity}, {stats.objects} objects{sized}")
            if stats.tier == "peer" and self.peer_address is not None:
                lines.append(peer_banner(self.peer_address, stats.extra.get("address", "")))
        return "\n".join(lines)


def peer_banner(address: PeerAddress, advertised: str) -> str:
    """The start banner's peer line: what other daemons dial, where it listens, and why."""
    listening = joined(address.host, address.port) if address.port else f"{address.host} (any free port)"
    return f"  peers: other daemons dial {advertised or address.advertise} (listening on {listening}: {address.note})"


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.0f} MiB"


def load_or_create_keyring(config: Config) -> tuple[Keyring, Path | None]:
    """The keyring at ``keys.keyring_file``, or a new one and the path it is to be saved at
    once the daemon started (``App.start``): a start that fails leaves no keyring behind."""
    path = config.keyring_path()
    if path.exists():
        _warn_if_others_can_read(path)
        return Keyring.load(path), None
    if config.redis.url is not None and config.keys.new_keyring_with_redis == "refuse":
        raise ConfigError(f"keys.keyring_file: {path} does not exist and redis.url is set: daemons that share "
                          f"Redis must share one keyring (statetier keygen --out FILE, then keys.keyring_file = FILE "
                          f"on every one of them); keys.new_keyring_with_redis = \"refuse\" forbids generating one "
                          f"here")
    return Keyring.generate(), path


def _warn_if_others_can_read(path: Path) -> None:
    """A keyring is the cluster's signing and peer-authentication secret: 0600, the daemon's
    (docs/operations.md §6). One that group or others can read is used, and said at start."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("keys.keyring_file %s has mode %04o: group or others can read the signing keyring (whoever "
                    "reads it can forge state every daemon of the cluster accepts); chmod 0600 it, owned by the "
                    "daemon's user (docs/operations.md §6)", path, mode)


def save_new_keyring(keyring: Keyring, path: Path, *, shared: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keyring.save(path)
    if shared:
        log.warning("generated a new signing keyring at %s while a Redis tier is configured: daemons that share "
                    "Redis must share one keyring (keys.keyring_file); objects sealed by daemons with another "
                    "keyring are refused here as unknown_key (and left in Redis), and theirs are refused there. "
                    "Set keys.new_keyring_with_redis = \"refuse\" to stop instead", path)
    else:
        log.info("generated a new signing keyring at %s", path)


def load_or_create_cipher(path: Path) -> AtRestCipher:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        key_id, key = os.urandom(8), os.urandom(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"format": "statetier-at-rest/1", "default": key_id.hex(),
                       "keys": {key_id.hex(): base64.b64encode(key).decode()}}, handle)
    try:
        data = json.loads(path.read_text())
        keys = {bytes.fromhex(k): base64.b64decode(v) for k, v in data["keys"].items()}
        return AtRestCipher(keys, bytes.fromhex(data["default"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"keys.at_rest_key_file {path}: {exc}") from exc


def build_tiers(config: Config, keyring: Keyring, executor,
                peer_address: PeerAddress | None = None) -> tuple[list[Tier], dict]:
    """Concrete tiers, fastest first, and the roles the engine needs (arena, publishing, …);
    the peer tier where ``peer_address`` (``peers.enabled``, resolved) is given."""
    from statetier.tiers.disk import DiskTier, DiskTierOptions
    from statetier.tiers.memory import DeviceTier, DeviceTierOptions, HostTier, HostTierOptions

    limits = config.limits
    tiers: list[Tier] = []
    roles: dict = {"arena": None, "publishing": Publishing(), "write_behind_to": None}
    if config.device.enabled:
        tiers.append(DeviceTier(DeviceTierOptions(
            config.device.capacity_bytes, device=config.device.device, high_watermark=config.device.high_watermark,
            low_watermark=config.device.low_watermark, lease_ttl=limits.lease_ttl_seconds), executor))
    if config.host.enabled:
        _warn_if_beyond_memory(config.host.capacity_bytes)
        host = HostTier(HostTierOptions(
            config.host.resolved_capacity(), shm_dir=config.host.shm_dir, populate=config.host.populate,
            high_watermark=config.host.high_watermark,
            low_watermark=config.host.low_watermark, lease_ttl=limits.lease_ttl_seconds), executor)
        tiers.append(host)
        roles["arena"] = host
    cipher = None
    if (config.disk.enabled and config.disk.encrypt) or (config.redis.url and config.redis.encrypt):
        cipher = load_or_create_cipher(config.at_rest_key_path())
    if config.disk.enabled:
        disk = DiskTier(DiskTierOptions(
            config.disk.directory, config.disk.capacity_bytes, segment_bytes=config.disk.segment_bytes,
            high_watermark=config.disk.high_watermark, low_watermark=config.disk.low_watermark,
            lease_ttl=limits.lease_ttl_seconds, fsync=config.disk.fsync),
            keyring=keyring, cipher=cipher if config.disk.encrypt else None, executor=executor)
        tiers.append(disk)
        roles["write_behind_to"] = disk
    if config.redis.url:
        from statetier.tiers.redis import RedisTier, RedisTierOptions

        redis_tier = RedisTier(RedisTierOptions(
            config.redis.url, cluster=config.redis.cluster, ttl_seconds=config.redis.ttl_seconds,
            capacity_bytes=config.redis.capacity_bytes, chunk_bytes=config.redis.chunk_bytes,
            lease_ttl=limits.lease_ttl_seconds, socket_timeout=config.redis.socket_timeout,
            start_unreachable=config.redis.start_unreachable),
            keyring=keyring, cipher=cipher if config.redis.encrypt else None, executor=executor)
        tiers.append(redis_tier)
        roles["publishing"] = Publishing(redis_tier, redis_tier, marks=_purge_marks_of(redis_tier))
        if peer_address is not None:
            _add_peer_tier(config, keyring, tiers, roles, peer_address)
    if not tiers:
        raise ConfigError("no tier is enabled: enable host, disk, device or set redis.url")
    return tiers, roles


def _add_peer_tier(config: Config, keyring: Keyring, tiers: list[Tier], roles: dict, address: PeerAddress) -> None:
    """The peer tier, before Redis: a copy a peer holds is pulled from it before Redis is
    read; a publish describes the object in the directory, and copies its bytes to Redis
    too only for the namespaces whose policy is ``descriptor+bytes``. It pulls a load
    batch's copies together (``batch_pulls``), and the write-behind yields to the pulls it
    answers (``write_behind_yields_to``)."""
    from statetier.tiers.peer import PeerTier, PeerTierOptions
    from statetier.tiers.peer.nixl import make_transport

    peers, redis_tier = config.peers, roles["publishing"].shared
    local = [t for t in tiers if t is not redis_tier and t.name != "device"]

    async def holds_locally(object_id: bytes) -> bool:
        return any([await t.contains(object_id) for t in local])

    assert config.redis.url is not None  # validated: peers need the directory
    options = PeerTierOptions(
        config.redis.url, owner_id=f"{config.resolved_producer_id()}/{os.urandom(4).hex()}",
        listen_host=address.host, listen_port=address.port, advertise=address.advertise,
        pull_timeout=peers.pull_timeout_seconds, ttl_seconds=config.redis.ttl_seconds,
        socket_buffer_bytes=peers.socket_buffer_bytes, lease_ttl=config.limits.lease_ttl_seconds,
        liveness_ttl=peers.liveness_ttl_seconds, encrypt=peers.encrypt)
    peer = PeerTier(options, keyring=keyring, local_tiers=local, holds_locally=holds_locally,
                    transport=make_transport(peers.transport, keyring, options, roles["arena"]))
    tiers.insert(tiers.index(redis_tier), peer)
    roles.update(publishing=dataclasses.replace(roles["publishing"], target=peer, keeps_bytes=peers.keeps_bytes),
                 batch_pulls=peer, write_behind_yields_to=peer.server.quiet)


def _purge_marks_of(tier: Tier) -> PurgeMarkStore | None:
    """The shared tier's declared capability, checked once here: whether it keeps the
    cluster's purge marks (``tiers.base.PurgeMarkStore``; the Redis tier declares it)."""
    return tier if isinstance(tier, PurgeMarkStore) else None


def _warn_if_beyond_memory(capacity: int | None) -> None:
    """A host arena sized past this machine's available memory starts (the memfd fills as
    it is used), but it will be killed or swap once full: said at start."""
    from .config import read_mem_available

    if capacity is None:
        return
    try:
        available = read_mem_available()
    except ConfigError:
        return
    if capacity > available:
        log.warning("host.capacity_bytes is %s, more than this machine's available memory (%s): the host arena "
                    "fills as it is used, and once past what the machine has the daemon swaps or is killed; "
                    "set host.capacity_bytes (--host-capacity) below it", _gib(capacity), _gib(available))


def build(config: Config) -> App:
    keyring, new_keyring_path = load_or_create_keyring(config)
    executor = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="statetier-io")
    peer_address = None
    if config.peers.enabled and config.redis.url is not None:
        peer_address = resolve_peer_address(config.peers.listen, config.peers.advertise, config.redis.url)
    tiers, roles = build_tiers(config, keyring, executor, peer_address)
    metrics = Metrics()
    watch = None
    if roles["publishing"].shared is not None:
        registry, watch = _shared_registry(config, roles["publishing"].shared, metrics)
    else:
        registry = MemoryVersionRegistry()
    quotas = {t.name: dict(t.quota_bytes) for t in config.tenants if t.quota_bytes}
    options = EngineOptions(lease_ttl=config.limits.lease_ttl_seconds, producer_id=config.resolved_producer_id(),
                            quotas=quotas, write_behind_limit=config.limits.write_behind_queue,
                            tolerate_unpublished=config.redis.publish_without_redis == "local")
    events = announcements = None
    if config.events.enabled:
        ev = config.events
        events = EventPublisher(ev.streams([t.name for t in config.tenants]), encoding=ev.encoding,
                                buffer=ev.buffer, buffer_bytes=ev.buffer_bytes, hwm=ev.hwm)
        announcements = Announcements(events, ev.media)
        metrics.track_events(events.stats)
    engine = Engine(tiers, keyring=keyring, registry=registry, metrics=metrics, options=options,
                    executor=executor, announcements=announcements, **roles)
    if watch is not None:
        watch.on_purge_marks = engine.take_purge_marks
    server = Server(engine, config, metrics)
    metrics.track(engine.tier_stats,
                  lambda: {**server.stats(), "leases": engine.lease_count,
                           "write_behind_pending": engine.placement.write_behind_pending,
                           "write_behind_limit": config.limits.write_behind_queue,
                           "tenants": _tenant_accounts(engine.tenancy.usage(), quotas)})
    http = None
    if config.metrics.enabled:
        http = MetricsServer(metrics, config.metrics.host, config.metrics.port, ready=_readiness(engine, watch))
    app = App(config, engine, server, metrics, http, executor, events, watch=watch, peer_address=peer_address)
    if new_keyring_path is not None:
        app.new_keyring = (keyring, new_keyring_path)
    return app


def _shared_registry(config: Config, redis_tier, metrics: Metrics) -> tuple[VersionRegistry, RedisWatch]:
    """The version registry in Redis, on the tier's edge (one deadline, one health probe),
    kept answering through an outage (``tiers.tolerant_registry``), and its probe."""
    from statetier.tiers.redis import RedisVersionRegistry

    assert config.redis.url is not None  # the publish tier is Redis, built from this URL
    shared = RedisVersionRegistry(config.redis.url, ttl_seconds=config.redis.ttl_seconds,
                                  socket_timeout=config.redis.socket_timeout, edge=redis_tier.edge)
    registry = TolerantRegistry(shared, on_outage=config.redis.on_outage)
    return registry, RedisWatch(redis_tier, registry, metrics, config.redis.probe_interval_seconds)


def _readiness(engine: Engine, watch: RedisWatch | None):
    def ready() -> bool | Readiness:
        if not engine.ready or watch is None:
            return engine.ready
        return watch.readiness()  # degraded is still ready: /readyz/strict alone says 503

    return ready


def _tenant_accounts(usage: dict[str, dict[str, int]], quotas: dict[str, dict[str, int]]) -> dict:
    """``{tenant: {tier: {"used": bytes, "quota": bytes or None}}}`` for the scrape."""
    accounts: dict[str, dict[str, dict]] = {}
    for tenant in set(usage) | set(quotas):
        for tier in set(usage.get(tenant, {})) | set(quotas.get(tenant, {})):
            accounts.setdefault(tenant, {})[tier] = {"used": usage.get(tenant, {}).get(tier, 0),
                                                     "quota": quotas.get(tenant, {}).get(tier)}
    return accounts


async def serve(config: Config, stop: asyncio.Event | None = None) -> None:
    app = build(config)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal() -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            os._exit(130)  # the second signal: exit at once, as operators expect
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await app.start()
    print(app.describe(), flush=True)
    try:
        await app.serve_until(stop)
    finally:
        print("statetier: shutting down", flush=True)
        await app.shutdown()


def run(config: Config) -> int:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # What this process imported (torch, the tiers, the metrics) lives as long as it does:
    # out of the collector's sight, no collection walks it again. Measured with gc.callbacks
    # on 64 KiB puts (docs/performance-notes.md): 7-12 µs of collections per put, 0.2 after.
    gc.freeze()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        uvloop = None  # type: ignore[assignment]  # mypy types an optional import as the module
    try:
        if uvloop is not None:
            uvloop.run(serve(config))
        else:
            asyncio.run(serve(config))
    except StatetierError as exc:
        print(f"error: {exc.reason}: {exc.message}", flush=True)
        return 2
    return 0
