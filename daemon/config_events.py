"""The ``[events]`` section: the KV event streams routers read (``daemon.events``).

- ``EventsConfig`` — off by default; ``endpoint`` / ``replay_endpoint`` (ZMQ addresses, in
  which ``{tenant}`` becomes each tenant's name), ``endpoints`` / ``replay_endpoints`` (a
  tenant's own addresses, e.g. a TCP port each), ``topic`` (``{namespace}``: the namespace
  digest in hex; ``{tenant}``), ``buffer`` / ``buffer_bytes`` (the replay ring), ``hwm`` (a
  subscriber's high-water mark), ``media`` (tier → ``medium`` name), ``encoding``.
- ``EventsConfig.streams(tenants)`` → one ``StreamSpec`` per tenant: each tenant gets its own
  PUB socket, so no subscriber can read another tenant's events whatever topic it asks for.
  Two tenants on one address is a ``ValueError`` naming the field (pydantic reports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from statetier.daemon.config_values import MiB, Bytes, known_tiers
from statetier.protocol.kv_events import Encoding

DEFAULT_MEDIA = {"device": "GPU", "host": "CPU", "disk": "DISK", "redis": "REDIS"}
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class StreamSpec:
    tenant: str
    endpoint: str
    replay_endpoint: str | None
    topic: str  # may still hold {namespace}


class EventsConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="Publish KV events (vLLM's format, over ZMQ) of what the daemon stores, "
                          "evicts, deletes and purges, per tier, one stream per tenant.")
    endpoint: str = Field("tcp://127.0.0.1:5557", description='ZMQ address each tenant\'s PUB socket binds; "{tenant}" '
                          "becomes the tenant's name (several tenants need it, or endpoints).")
    replay_endpoint: str | None = Field(None, description='ZMQ address of the replay (ROUTER) socket; "{tenant}" as '
                                        "above; None = no replay.")
    endpoints: dict[str, str] = Field(default_factory=dict, description="Tenant → its own PUB address (instead of "
                                      "endpoint), e.g. a TCP port per tenant.")
    replay_endpoints: dict[str, str] = Field(default_factory=dict, description="Tenant → its own replay address.")
    topic: str = Field("{namespace}", description='Topic of each message; "{namespace}" becomes the namespace digest '
                       '(hex), "{tenant}" the tenant; subscribers filter by its prefix.')
    buffer: int = Field(10_000, gt=0, description="Batches of events each stream keeps for replay (the oldest leave "
                        "first); also the bound of batches waiting for the publisher thread.")
    buffer_bytes: Bytes = Field(64 * MiB, description="Bytes of encoded batches each stream keeps for replay at most.")
    hwm: int = Field(10_000, gt=0, description="Messages queued for one subscriber before it misses batches "
                     "(counted in statetier_event_overflows_total; it replays the gap; the others get them).")
    media: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_MEDIA),
        description="Tier → the medium name its events carry.")
    encoding: Encoding = Field("map", description='Events as tagged maps ("map", as vLLM 0.32 writes '
                                              'them) or tagged arrays ("array", vLLM\'s earlier releases).')

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, address: str | None) -> str | None:
        if address is not None and not address.startswith(_ZMQ_SCHEMES):
            raise ValueError(f"must start with {', '.join(_ZMQ_SCHEMES)}")
        return address

    @field_validator("endpoints", "replay_endpoints")
    @classmethod
    def _zmq_addresses(cls, addresses: dict[str, str]) -> dict[str, str]:
        for tenant, address in addresses.items():
            if not address.startswith(_ZMQ_SCHEMES):
                raise ValueError(f"{tenant}: must start with {', '.join(_ZMQ_SCHEMES)}")
        return addresses

    @field_validator("media")
    @classmethod
    def _known_tiers(cls, media: dict[str, str]) -> dict[str, str]:
        return {**DEFAULT_MEDIA, **known_tiers(media)}

    def streams(self, tenants: list[str]) -> list[StreamSpec]:
        """One stream per tenant; ``ValueError`` naming the field when two share an address."""
        for field_name in ("endpoints", "replay_endpoints"):
            unknown = sorted(set(getattr(self, field_name)) - set(tenants))
            if unknown:
                raise ValueError(f"events.{field_name}: {unknown[0]!r} is not a configured tenant")
        specs = []
        for tenant in tenants:
            replay = self.replay_endpoints.get(tenant, self.replay_endpoint)
            specs.append(StreamSpec(tenant, self.endpoints.get(tenant, self.endpoint.replace("{tenant}", tenant)),
                                    None if replay is None else replay.replace("{tenant}", tenant),
                                    self.topic.replace("{tenant}", tenant)))
        taken: dict[str, str] = {}
        for spec in specs:
            for field_name, address in (("endpoint", spec.endpoint), ("replay_endpoint", spec.replay_endpoint)):
                if address is None:
                    continue
                if address in taken:
                    raise ValueError(f"events.{field_name}: tenants {taken[address]!r} and {spec.tenant!r} would share "
                                     f"{address}; put {{tenant}} in it or give each its own in events.{field_name}s")
                taken[address] = spec.tenant
        return specs

