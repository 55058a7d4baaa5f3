"""What the ``statetier`` client commands take from the environment (read here, and only here;
the daemon's own configuration is ``daemon.config_loading``'s). No pydantic, no torch.

- ``DEFAULT_CLIENT_URL`` — ``unix://./statetier.sock``, where ``make run`` listens.
- ``client_url_from_env(env)`` — ``$STATETIER_URL``, else ``DEFAULT_CLIENT_URL``.
- ``client_token_from_env(env)`` — ``$STATETIER_TOKEN`` (a tenant's bearer token), else None.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_CLIENT_URL = "STATETIER_URL"
ENV_CLIENT_TOKEN = "STATETIER_TOKEN"
DEFAULT_CLIENT_URL = "unix://./statetier.sock"


def client_url_from_env(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get(ENV_CLIENT_URL) or DEFAULT_CLIENT_URL


def client_token_from_env(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return env.get(ENV_CLIENT_TOKEN) or None
