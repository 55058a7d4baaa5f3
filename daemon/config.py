"""The daemon's configuration: one frozen pydantic model tree.

- ``Config`` — sections ``host``, ``device``, ``disk``, ``redis`` (tiers), ``listen``,
  ``tenants``, ``limits``, ``keys``, ``metrics``, ``events`` (``daemon.config_events``), plus
  ``log_level`` and ``producer_id``;
  the questions the daemon asks of it (``keyring_path``, ``tenant_for_uid``,
  ``is_unix_peer_allowed``…). Every section is frozen, ``extra="forbid"``, every field
  described; validators reject a bad value or combination with the field's name.
- The sections: ``HostTierConfig``, ``DeviceTierConfig``, ``DiskTierConfig``,
  ``RedisTierConfig``, ``ListenConfig``, ``TenantConfig``, ``LimitsConfig``,
  ``KeysConfig``, ``MetricsConfig``. Sizes accept ints or strings with units
  ("64MiB", "2GB": ``daemon.config_values``).

Built by ``daemon.config_loading.load_config`` (defaults ← TOML ← environment ←
``--set``), once, by ``statetier serve`` before ``daemon.app.run(config)``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from statetier.daemon.config_events import EventsConfig
from statetier.daemon.config_values import (
    GiB, KiB, MiB, Bytes, FileMode, Seconds, known_tiers, parse_size, split_host_port)
from statetier.protocol.errors import ConfigError

HOST_AUTO_MIN, HOST_AUTO_MAX = 64 * MiB, 64 * GiB


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Watermarks(_Section):
    """Eviction starts above ``high_watermark`` × capacity and stops at ``low_watermark`` ×."""

    high_watermark: float = Field(0.9, gt=0, le=1,
                                  description="Fraction of capacity above which the tier evicts (demotes).")
    low_watermark: float = Field(0.75, gt=0, le=1, description="Fraction of capacity eviction brings usage down "
                                 "to; below high_watermark.")

    @field_validator("low_watermark")
    @classmethod
    def _below_high(cls, low: float, info) -> float:
        high = info.data.get("high_watermark")
        if high is not None and not low < high:
            raise ValueError(f"must be below high_watermark ({high})")
        return low


class HostTierConfig(_Watermarks):
    enabled: bool = Field(True,
                          description="Keep a shared-memory host tier (the zero-copy path for same-host clients).")
    capacity_bytes: Bytes | None = Field(
        None, description="Arena size; None = 25% of MemAvailable at start, clamped to [64 MiB, 64 GiB]."
    )
    shm_dir: Path | None = Field(
        None, description="None = the arena is an anonymous memfd (nothing any other process can open); a directory "
        "(a tmpfs) = a named arena file there, mode 0600, owned by the daemon, removed at exit and, when a dead "
        "daemon left one, at the next start. Clients never map the arena either way.")
    populate: bool = Field(
        True, description="Fault the whole arena in at start, on a background thread (madvise "
        "MADV_POPULATE_WRITE, Linux 5.14+), so a fresh put does not fault page by page; the arena is then charged "
        "to the daemon's memory from start. False: charged as it is touched.")
    window_bytes: Annotated[int, BeforeValidator(parse_size), Field(ge=0)] = Field(
        64 * MiB, description="Per same-host connection: size of each of its two shared-memory windows (put, "
        "load), passed over the socket; memory is used only where touched. 0 turns the zero-copy path off.")

    def resolved_capacity(self, mem_available: int | None = None) -> int:
        """``capacity_bytes``, or 25% of available memory (``/proc/meminfo``) clamped."""
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        available = read_mem_available() if mem_available is None else mem_available
        return max(HOST_AUTO_MIN, min(HOST_AUTO_MAX, available // 4))


class DeviceTierConfig(_Watermarks):
    enabled: bool = Field(False, description="Keep a GPU-memory tier (runs on cpu when CUDA is absent).")
    device: str = Field("cuda:0", pattern=r"^(cuda(:\d+)?|cpu)$", description="torch device of the slab pool.")
    capacity_bytes: Bytes = Field(1 * GiB, description="Bytes of device memory preallocated for the pool.")


class DiskTierConfig(_Watermarks):
    enabled: bool = Field(True, description="Keep the disk tier (segment files + LMDB index).")
    directory: Path = Field(Path("./statetier-data"),
                            description="Directory of segments, index and (by default) the keyring.")
    capacity_bytes: Bytes = Field(16 * GiB, description="Bytes of live objects the disk tier may hold.")
    segment_bytes: Bytes = Field(64 * MiB, description="Size at which a segment file is sealed and a new one started.")
    fsync: bool = Field(True, description="fdatasync the segment (object records and their commit record) before a "
                        "store completes; the LMDB index is a synced checkpoint written in the background.")
    encrypt: bool = Field(False, description="Encrypt payloads at rest (AES-256-GCM, keys.at_rest_key_file).")
    compact_interval_seconds: Seconds = Field(30.0,
                                              description="Seconds between compaction passes over sparse segments.")


class RedisTierConfig(_Section):
    url: str | None = Field(
        None, description="redis://, rediss:// (TLS) or unix:// URL, ACL user in the URL; None = no Redis tier."
    )
    cluster: bool | None = Field(None, description="Redis Cluster; None = detect at start.")
    ttl_seconds: int | None = Field(3600, gt=0, description="Expiry of stored objects; None = no expiry.")
    capacity_bytes: Bytes | None = Field(None, description="Bytes this daemon may keep in Redis; None = unbounded "
                                         "(TTL/maxmemory).")
    chunk_bytes: Bytes = Field(2 * MiB, description="Large sealed values are split into chunks of this size.")
    encrypt: bool = Field(False, description="Encrypt payloads at rest (AES-256-GCM, keys.at_rest_key_file).")
    socket_timeout: Seconds = Field(5.0, description="Deadline of one Redis call, every retry and the wait for a "
                                    "connection included: what a hung Redis may cost a request.")
    on_outage: Literal["local", "refuse"] = Field(
        "local", description='Puts while Redis is unreachable: "local" (versions from what this daemon knows, '
        'written to Redis when it answers again) or "refuse" (RegistryUnavailable, nothing stored). Loads and '
        'lookups of local copies are served either way; a put with publish=true is refused.')
    start_unreachable: Literal["degraded", "refuse"] = Field(
        "degraded", description='Redis not answering at start: "degraded" (start, serve what is local, reconnect '
        'with the health probe) or "refuse" (exit naming redis.url).')
    probe_interval_seconds: Seconds = Field(1.0, description="How often the health probe PINGs Redis "
                                            "(statetier_redis_up, /readyz).")
    publish_without_redis: Literal["refuse", "local"] = Field(
        "refuse", description='A put with publish=true when no Redis tier is configured: "refuse" (Unavailable, '
        'nothing stored) or "local" (stored here only; the reply says published=false and '
        'statetier_unpublished_puts_total counts it).')

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        if url is not None and not re.match(r"^(redis|rediss|unix)://.", url):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return url



class PeersConfig(_Section):
    enabled: bool = Field(False, description="Serve this daemon's published objects to the other daemons of the "
                          "cluster and pull theirs (the peer tier); needs redis.url (the directory).")
    listen: str = Field("", pattern=r"^(.+:\d{1,5})?$", description="host:port the peer listener binds (port 0: "
                        "any free port); empty = chosen from redis.url: 127.0.0.1 on any free port when Redis is on "
                        "this host, else every interface on port 9465, advertised as this host's address toward "
                        "Redis (daemon/peer_address.py). A loopback listen with Redis elsewhere is refused.")
    advertise: str = Field("", pattern=r"^(.+:\d{1,5})?$", description="host:port other daemons dial (in "
                           "Kubernetes: the pod IP and the peer port); empty = as peers.listen resolves it.")
    policy: Literal["descriptor", "descriptor+bytes"] = Field(
        "descriptor", description='What a publish puts in Redis: "descriptor" (header, size, owner: the bytes stay '
        'here and peers pull them) or "descriptor+bytes" (also a Redis copy that outlives this daemon).')
    namespace_policies: dict[str, Literal["descriptor", "descriptor+bytes"]] = Field(
        default_factory=dict, description="Per-namespace policy, by the namespace digest in hex (as `statetier ls` "
        "shows it); the others follow policy.")
    pull_timeout_seconds: Seconds = Field(5.0, description="Deadline of one pull from a peer (connect, handshake, "
                                          "bytes, a redial and retries): past it the load goes on to the next copy "
                                          "(PeerLost); the owner is fenced only on evidence its process is gone.")
    liveness_ttl_seconds: Seconds = Field(6.0, ge=0.3, description="TTL of the liveness key this daemon renews in "
                                          "the directory every third of it: how soon the others stop offering its "
                                          "objects once its process is gone, and how soon it publishes them again "
                                          "after Redis restarted empty.")
    socket_buffer_bytes: Bytes = Field(8 * MiB, description="SO_RCVBUF / SO_SNDBUF of peer connections.")
    transport: Literal["tcp", "nixl"] = Field(
        "tcp", description='How a pull moves the bytes: "tcp" (statetier\'s frames on the peer connection) or '
        '"nixl" (a NIXL READ from the owner\'s registered arena over UCX: RDMA, NVLink, EFA or TCP; needs the '
        'nixl extra, pip install "statetier[nixl]", on every daemon; docs/scaling.md).')
    encrypt: bool = Field(False, description="Pull the bytes from peers encrypted: AES-256-GCM under a key derived "
                          "from each connection's authenticated handshake, an object's pages and states hidden from "
                          "the network (their integrity is checked either way); an answer in the clear (an owner of "
                          "an older release) is refused. Costs one pass over the bytes on each side (the owner "
                          "encrypts, this daemon decrypts where they land). Every daemon answers encrypted when asked, "
                          "whatever its own setting. The tcp transport only: refused with transport = \"nixl\" "
                          "(docs/operations.md).")

    @model_validator(mode="after")
    def _encrypt_needs_tcp(self) -> "PeersConfig":
        if self.encrypt and self.transport != "tcp":
            raise ValueError('encrypt covers the "tcp" transport only: a NIXL read moves the owner\'s bytes '
                             "as they lie, in the clear")
        return self

    def keeps_bytes(self, namespace: bytes) -> bool:
        return self.namespace_policies.get(namespace.hex(), self.policy) == "descriptor+bytes"


class ListenConfig(_Section):
    socket_path: Path = Field(Path("./statetier.sock"), description="Unix socket the daemon listens on.")
    socket_mode: FileMode = Field(
        0o660, description='File mode of the socket (octal: 0o660 in TOML, "660" or 660 in the environment and --set).'
    )
    allowed_uids: tuple[int, ...] = Field(
        (), description="Peer uids allowed on the socket; empty = the daemon's own uid and root."
    )
    allowed_gids: tuple[int, ...] = Field((), description="Peer gids allowed on the socket.")
    operator_uids: tuple[int, ...] = Field(
        (), description="Unix peer uids that may list and purge every tenant's state (statetier ls --all, "
        "statetier purge --of-tenant); empty = the daemon's own uid and root. Others list and purge their own tenant's."
    )
    tcp: str | None = Field(None,
                            description='"host:port" ("[::1]:7000" for IPv6) to listen on TCP too; None = Unix only.')
    tls_cert: Path | None = Field(None, description="PEM certificate for TCP (with tls_key).")
    tls_key: Path | None = Field(None, validate_default=True, description="PEM private key for TCP (with tls_cert).")
    tls_client_ca: Path | None = Field(
        None, validate_default=True, description="CA bundle; set = TCP clients must present a certificate (mutual TLS)."
    )

    @field_validator("tcp")
    @classmethod
    def _host_port(cls, tcp: str | None) -> str | None:
        if tcp is not None:
            split_host_port(tcp)
        return tcp

    @field_validator("tls_key")
    @classmethod
    def _key_with_cert(cls, key: Path | None, info) -> Path | None:
        cert = info.data.get("tls_cert")
        if (cert is None) != (key is None) and "tls_cert" in info.data:
            raise ValueError("tls_cert and tls_key go together")
        if key is not None and info.data.get("tcp") is None and "tcp" in info.data:
            raise ValueError("TLS applies to TCP only: set listen.tcp too")
        return key

    @field_validator("tls_client_ca")
    @classmethod
    def _ca_needs_tls(cls, ca: Path | None, info) -> Path | None:
        if ca is not None and info.data.get("tls_key") is None and "tls_key" in info.data:
            raise ValueError("mutual TLS needs tls_cert and tls_key")
        return ca

    def tcp_address(self) -> tuple[str, int] | None:
        return None if self.tcp is None else split_host_port(self.tcp)


class TenantConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Tenant name (sent in HELLO).")
    token_sha256: str | None = Field(
        None, pattern=r"^[0-9a-fA-F]{64}$", description="Hex sha256 of the bearer token TCP clients authenticate with."
    )
    uids: tuple[int, ...] = Field((), description="Unix-socket peer uids mapped to this tenant.")
    quota_bytes: dict[str, Annotated[int, BeforeValidator(parse_size), Field(ge=0)]] = Field(
        default_factory=dict, description="Tier name (device, host, disk, redis) → bytes this tenant may hold there; "
        "every copy counts (write-behind, publish, promotion), a demotion moves the bytes to the lower tier."
    )

    @field_validator("token_sha256")
    @classmethod
    def _lower(cls, token: str | None) -> str | None:
        return None if token is None else token.lower()

    @field_validator("quota_bytes")
    @classmethod
    def _known_tiers(cls, quotas: dict[str, int]) -> dict[str, int]:
        return known_tiers(quotas)

    def accepts_token(self, token: str) -> bool:
        if self.token_sha256 is None:
            return False
        # surrogatepass: a token that is not valid text matches nothing instead of raising
        return hmac.compare_digest(hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest(),
                                   self.token_sha256)


class LimitsConfig(_Section):
    max_frame_bytes: Bytes = Field(65 * MiB, description="Largest frame accepted or sent.")
    max_inflight_per_connection: int = Field(64, gt=0, description="Requests one connection may have in flight.")
    byte_budget: Bytes = Field(1 * GiB,
                               description="Payload bytes in flight across all connections before requests wait.")
    busy_wait_seconds: Seconds = Field(2.0, description="How long a request waits for budget before Busy.")
    lease_ttl_seconds: Seconds = Field(30.0, description="Deadline of a lease a client holds.")
    shutdown_grace_seconds: Seconds = Field(10.0,
                                            description="On SIGTERM, time in-flight requests get before cancellation.")
    write_behind_queue: int = Field(256, gt=0, description="Demotions queued for write-behind before puts wait.")


class KeysConfig(_Section):
    keyring_file: Path | None = Field(
        None, description="Signing keyring (statetier keygen); None = <disk dir>/keyring.json, generated at first "
        "start (0600)."
    )
    at_rest_key_file: Path | None = Field(
        None, description="AES-256 key for tiers with encrypt=true; None = <disk dir>/at-rest.key, generated at "
        "first start (0600)."
    )
    new_keyring_with_redis: Literal["warn", "refuse"] = Field(
        "warn", description='A cross-node tier (redis.url) and no keyring file yet: "warn" generates one and logs '
        "that daemons sharing Redis must share keys.keyring_file (each other's objects are refused as unknown_key "
        'otherwise); "refuse" stops the daemon instead, before anything is written.')


class MetricsConfig(_Section):
    enabled: bool = Field(True, description="Serve /metrics, /healthz and /readyz over HTTP.")
    host: str = Field("127.0.0.1", description="Address the metrics HTTP server binds.")
    port: int = Field(9464, ge=0, le=65535, description="Port of the metrics HTTP server (0 = ephemeral).")


class Config(_Section):
    host: HostTierConfig = Field(default_factory=HostTierConfig, description="Shared-memory host tier.")
    device: DeviceTierConfig = Field(default_factory=DeviceTierConfig, description="GPU-memory tier.")
    disk: DiskTierConfig = Field(default_factory=DiskTierConfig, description="Disk tier.")
    redis: RedisTierConfig = Field(default_factory=RedisTierConfig, description="Redis tier (cross-node).")
    peers: PeersConfig = Field(default_factory=PeersConfig, description="Daemon-to-daemon pulls, Redis the "
                               "directory.")
    listen: ListenConfig = Field(default_factory=ListenConfig, description="Sockets and transport security.")
    tenants: tuple[TenantConfig, ...] = Field(
        default_factory=lambda: (TenantConfig(name="default"),),
        description='Tenants; an allowed Unix peer that maps to no tenant gets "default" when it exists.',
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Frames, budgets, deadlines.")
    keys: KeysConfig = Field(default_factory=KeysConfig, description="Signing and at-rest key files.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus HTTP endpoint.")
    events: EventsConfig = Field(default_factory=EventsConfig, description="KV event streams for routers.")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field("info", description="Logging level.")
    producer_id: str = Field("", max_length=255,
                             description='Producer id sealed into provenance; "" = hostname:pid at start.')

    @field_validator("log_level", mode="before")
    @classmethod
    def _lowercase(cls, level: object) -> object:
        return level.lower() if isinstance(level, str) else level

    @field_validator("tenants")
    @classmethod
    def _unique_tenants(cls, tenants: tuple[TenantConfig, ...]) -> tuple[TenantConfig, ...]:
        names: set[str] = set()
        uids: dict[int, str] = {}
        for tenant in tenants:
            if tenant.name in names:
                raise ValueError(f"tenant name {tenant.name!r} appears twice")
            names.add(tenant.name)
            for uid in tenant.uids:
                if uid in uids:
                    raise ValueError(f"uid {uid} is mapped to both {uids[uid]!r} and {tenant.name!r}")
                uids[uid] = tenant.name
        return tenants

    @field_validator("peers")
    @classmethod
    def _peers_need_a_directory(cls, peers: PeersConfig, info) -> PeersConfig:
        redis = info.data.get("redis")
        if peers.enabled and redis is not None and redis.url is None:
            raise ValueError("peers.enabled needs redis.url: the directory of who holds what lives in Redis")
        return peers

    @field_validator("events")
    @classmethod
    def _one_stream_per_tenant(cls, events: EventsConfig, info) -> EventsConfig:
        tenants = info.data.get("tenants")
        if events.enabled and tenants is not None:
            events.streams([t.name for t in tenants])
        return events

    def keyring_path(self) -> Path:
        return self.keys.keyring_file or self.disk.directory / "keyring.json"

    def at_rest_key_path(self) -> Path:
        return self.keys.at_rest_key_file or self.disk.directory / "at-rest.key"

    def resolved_producer_id(self) -> str:
        return self.producer_id or f"{socket.gethostname()}:{os.getpid()}"

    def tenant_named(self, name: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.name == name), None)

    def is_unix_peer_allowed(self, uid: int, gid: int, own_uid: int | None = None) -> bool:
        """Allowed uids (default: own uid and root), allowed gids, or a uid a tenant lists."""
        allowed = set(self.listen.allowed_uids) or {os.getuid() if own_uid is None else own_uid, 0}
        return uid in allowed or gid in self.listen.allowed_gids or any(uid in t.uids for t in self.tenants)

    def tenant_for_uid(self, uid: int) -> str | None:
        """The tenant an allowed Unix peer maps to: the one listing ``uid``, else "default"."""
        for tenant in self.tenants:
            if uid in tenant.uids:
                return tenant.name
        return "default" if self.tenant_named("default") is not None else None

    def tenant_for_token(self, token: str) -> str | None:
        return next((t.name for t in self.tenants if t.accepts_token(token)), None)



def read_mem_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    except (OSError, ValueError, IndexError) as exc:
        raise ConfigError(f"host.capacity_bytes: cannot size from {meminfo}: {exc}; set it explicitly") from exc
    raise ConfigError(f"host.capacity_bytes: no MemAvailable in {meminfo}; set it explicitly")
