"""Where the daemon listens, from the URL a client is given.

- ``parse_url(url)`` → ``Endpoint``: ``unix:///abs.sock``, ``unix:rel.sock`` or a bare socket
  path (``path``); ``tcp://host:port`` or ``tcps://host:port`` (``host``, ``port``, ``tls``).
  Anything else is ``InvalidRequest`` naming the URL. Used by ``transport.connect``.
  ``str(endpoint)`` is its URL again, as messages name it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from statetier.protocol.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the daemon listens: a Unix socket ``path``, or ``host``:``port`` over TCP."""

    path: str | None = None
    host: str | None = None
    port: int | None = None
    tls: bool = False

    @property
    def is_unix(self) -> bool:
        return self.path is not None

    def __str__(self) -> str:
        """The URL form (``unix://./statetier.sock``, ``tcp://host:port``): what messages name."""
        if self.path is not None:
            return f"unix://{self.path}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host  # IPv6
        return f"{'tcps' if self.tls else 'tcp'}://{host}:{self.port}"


def parse_url(url: str) -> Endpoint:
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"daemon url must be a non-empty string, not {url!r}")
    if url.startswith("unix://"):
        path = url[len("unix://"):]
    elif url.startswith("unix:"):
        path = url[len("unix:"):]
    elif "://" not in url:
        path = url
    else:
        parts = urlsplit(url)
        if parts.scheme not in ("tcp", "tcps"):
            raise InvalidRequest(f"unknown daemon url scheme {parts.scheme!r}: use unix://, tcp:// or tcps://")
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise InvalidRequest(f"daemon url {url!r} needs a host and a port")
        return Endpoint(host=parts.hostname, port=port, tls=parts.scheme == "tcps")
    if not path:
        raise InvalidRequest(f"daemon url {url!r} names no socket path")
    return Endpoint(path=path)
