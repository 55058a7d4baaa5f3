"""Who is on the other end of a connection, and which tenant it acts as (DESIGN §7).

- ``PeerCredentials`` / ``peer_credentials(sock)`` — pid, uid, gid of a Unix-socket peer
  (``SO_PEERCRED``), read once when the connection is made.
- ``is_operator(creds, listen)`` — the peer's uid is in ``listen.operator_uids`` (empty = the
  daemon's own uid and root): it may list and purge every tenant's state.
- ``check_peer(creds, listen, tenant_uids=())`` — ``Forbidden`` unless the peer's uid is
  allowed (``listen.allowed_uids``; empty = the daemon's own uid and root), is listed by a
  tenant (``tenant_uids``: ``TenantDirectory.uids``), or its gid is in
  ``listen.allowed_gids`` — the rule of ``Config.is_unix_peer_allowed``. Runs before any
  frame is read.
- ``TenantDirectory(tenants)`` — ``resolve(hello_meta, peer, tls_verified)`` → tenant
  name for a HELLO:
    * a ``token`` in HELLO (any transport) is hashed with SHA-256 and compared in constant
      time against every tenant's ``token_sha256``; no match, or a token that is not valid
      UTF-8 text → ``Unauthorized``;
    * otherwise, on the Unix socket, the tenant whose ``uids`` contain the peer's uid;
    * otherwise ``"default"`` when such a tenant is configured (or no tenants are
      configured at all: a single-tenant deployment) — on TCP only when mutual TLS has
      verified the client's certificate;
    * otherwise ``Unauthorized``.
  A ``tenant`` named in HELLO must equal the resolved one (``Forbidden`` otherwise), except
  that ``"default"`` (what SDK clients send unless told otherwise) means "whichever my
  credentials give me" — and on the Unix socket it may also pick the default tenant,
  which any allowed peer may use anyway. HELLO_OK reports the tenant resolved.
- ``server_ssl_context(listen, on_handshake_failure=None)`` — the TLS context for the TCP
  listener, or ``None``; with ``tls_client_ca`` set, client certificates are required
  (mutual TLS). A failed handshake (a certificate our CA did not sign, none, not TLS at
  all) never reaches a ``Connection``; ``on_handshake_failure(exc)`` is how it is counted.

Errors carry ``detail["auth"]``, a bounded label for ``metrics.count_auth_failure``; the
names a peer sent appear in them only through ``quote_untrusted`` (bounded, escaped).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
import struct
from dataclasses import dataclass

from statetier.protocol.errors import ConfigError, Forbidden, InvalidRequest, Unauthorized, quote_untrusted

DEFAULT_TENANT = "default"
_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock) -> PeerCredentials:
    """``SO_PEERCRED`` of a connected Unix socket (a socket or an asyncio transport socket)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return PeerCredentials(*_PEERCRED.unpack(raw))


def allowed_uids(listen) -> frozenset[int]:
    configured = frozenset(listen.allowed_uids or ())
    return configured or frozenset({os.getuid(), 0})


def is_operator(creds: PeerCredentials, listen) -> bool:
    """A Unix peer that may list and purge every tenant's state: ``listen.operator_uids``
    (empty = the daemon's own uid and root)."""
    configured = frozenset(getattr(listen, "operator_uids", ()) or ())
    return creds.uid in (configured or frozenset({os.getuid(), 0}))


def check_peer(creds: PeerCredentials, listen, tenant_uids=()) -> None:
    """Refuse a Unix-socket peer whose uid and gid are both outside the allowed sets."""
    if creds.uid in allowed_uids(listen) or creds.uid in tenant_uids \
            or creds.gid in frozenset(listen.allowed_gids or ()):
        return
    raise Forbidden(
        f"peer uid {creds.uid} / gid {creds.gid} (pid {creds.pid}) may not use this socket",
        auth="peer_credentials",
    )


def token_sha256(token: str) -> str:
    """The hex digest a tenant's ``token_sha256`` holds for ``token``; ``Unauthorized`` for
    a token that is not text UTF-8 can carry (a lone surrogate sent as a JSON escape)."""
    try:
        encoded = token.encode("utf-8")
    except UnicodeEncodeError:
        raise Unauthorized("the token is not valid UTF-8 text", auth="token") from None
    return hashlib.sha256(encoded).hexdigest()


@dataclass(frozen=True, slots=True)
class _Tenant:
    name: str
    token_sha256: str | None
    uids: frozenset[int]


class TenantDirectory:
    """Maps HELLO credentials to a tenant name; see the module docstring for the rules."""

    def __init__(self, tenants) -> None:
        self._tenants = tuple(
            _Tenant(
                t.name,
                t.token_sha256.lower() if getattr(t, "token_sha256", None) else None,
                frozenset(getattr(t, "uids", None) or ()),
            )
            for t in tenants or ()
        )
        names = {t.name for t in self._tenants}
        self._has_default = not self._tenants or DEFAULT_TENANT in names
        self.uids: frozenset[int] = frozenset().union(*(t.uids for t in self._tenants))

    def resolve(self, hello: dict, peer: PeerCredentials | None, tls_verified: bool = False) -> str:
        token = hello.get("token")
        requested = hello.get("tenant")
        if token is not None and not isinstance(token, str):
            raise InvalidRequest("HELLO field 'token' must be a string")
        if requested is not None and not isinstance(requested, str):
            raise InvalidRequest("HELLO field 'tenant' must be a string")
        requested = self._insisted_on(requested, token, peer)
        if token:
            name = self._by_token(token)
        elif peer is not None:
            name = self._by_uid(peer.uid, requested)
        elif tls_verified and self._has_default:
            name = DEFAULT_TENANT
        else:
            raise Unauthorized("a bearer token is required on TCP", auth="token")
        if requested and requested != name:
            raise Forbidden(
                f"these credentials belong to tenant {quote_untrusted(name)}, not {quote_untrusted(requested)}",
                auth="tenant",
            )
        return name

    def _insisted_on(self, requested: str | None, token: str | None, peer) -> str | None:
        """The tenant HELLO insists on. ``"default"`` is the SDK's default, so it insists only
        where it is a real choice: a Unix peer without a token, with a default tenant."""
        if requested != DEFAULT_TENANT:
            return requested
        return requested if peer is not None and not token and self._has_default else None

    def _by_token(self, token: str) -> str:
        digest = token_sha256(token)
        found = None
        for tenant in self._tenants:  # no early exit: the time does not depend on the match
            expected = tenant.token_sha256 or ""
            if hmac.compare_digest(digest, expected) and found is None:
                found = tenant.name
        if found is None:
            raise Unauthorized("unknown token", auth="token")
        return found

    def _by_uid(self, uid: int, requested: str | None) -> str:
        names = [t.name for t in self._tenants if uid in t.uids]
        if requested in names or (requested == DEFAULT_TENANT and self._has_default):
            return requested
        if names:
            return names[0]
        if self._has_default:
            return DEFAULT_TENANT
        raise Unauthorized(f"no tenant is configured for uid {uid}", auth="tenant")


def server_ssl_context(listen, on_handshake_failure=None) -> ssl.SSLContext | None:
    """TLS for the TCP listener from ``tls_cert``/``tls_key`` (+ ``tls_client_ca``: mTLS)."""
    cert, key, client_ca = listen.tls_cert, listen.tls_key, listen.tls_client_ca
    if not cert:
        if client_ca:
            raise ConfigError("listen.tls_client_ca needs listen.tls_cert and listen.tls_key")
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key) if key else None)
        if client_ca:
            context.load_verify_locations(cafile=str(client_ca))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate, key or client CA: {exc}") from exc
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
    if on_handshake_failure is not None:
        context.sslobject_class = _handshake_observer(on_handshake_failure)
    return context


def _handshake_observer(on_failure) -> type[ssl.SSLObject]:
    """An ``SSLObject`` class (what the event loop's TLS layer wraps each connection in)
    that reports a failed handshake: the loop itself only closes such a connection."""

    class ObservedSSLObject(ssl.SSLObject):
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise
            except ssl.SSLError as exc:
                on_failure(exc)
                raise

    return ObservedSSLObject
