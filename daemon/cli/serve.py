"""``statetier serve``, ``statetier config`` and ``statetier bench``.

- ``config_overrides(args)`` — the serve flags as dotted config overrides (unset flags absent).
- ``config_file(args, env, cwd)`` — the TOML file to read: ``--config``, else
  ``$STATETIER_CONFIG``, else ``./statetier.toml`` when it exists (said on stderr, so a file
  there is never silently ignored, nor silently used), else none.
- ``run_serve`` — load and validate the configuration, then ``daemon.app.run`` (imported only
  now: it builds every tier). ``run_config`` — the effective configuration as JSON, Redis
  passwords masked, file modes in octal. ``run_bench`` — ``statetier.benchmarks.cli.main``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Mapping

from statetier.daemon.config_loading import ENV_CONFIG_FILE, load_config, parse_setting
from statetier.protocol.errors import ConfigError

LOCAL_CONFIG = "statetier.toml"

# serve flag → dotted config key
_SERVE_FLAGS = {
    "socket": "listen.socket_path",
    "tcp": "listen.tcp",
    "disk_dir": "disk.directory",
    "redis_url": "redis.url",
    "metrics_host": "metrics.host",
    "metrics_port": "metrics.port",
    "host_capacity": "host.capacity_bytes",
    "keyring": "keys.keyring_file",
    "log_level": "log_level",
}


def config_overrides(args: argparse.Namespace) -> dict[str, object]:
    overrides: dict[str, object] = {}
    for flag, key in _SERVE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = value
    if args.no_metrics:
        overrides["metrics.enabled"] = False
    if args.device is not None:
        overrides["device.enabled"] = True
        overrides["device.device"] = args.device
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = parse_setting(key.strip(), raw)
    return overrides


def config_file(args: argparse.Namespace, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str | None:
    env = os.environ if env is None else env
    if args.config:
        return str(args.config)
    if env.get(ENV_CONFIG_FILE):
        return env[ENV_CONFIG_FILE]
    local = (cwd or Path.cwd()) / LOCAL_CONFIG
    if local.is_file():
        print(f"statetier: reading {local} (found in the current folder; --config FILE or "
              f"${ENV_CONFIG_FILE} names another)", file=sys.stderr)
        return str(local)
    return None


def load(args: argparse.Namespace):
    return load_config(config_file(args), overrides=config_overrides(args))


def run_serve(args: argparse.Namespace) -> int:
    config = load(args)
    from statetier.daemon.app import run  # only now: the composition root imports every tier

    return run(config)


def run_config(args: argparse.Namespace) -> int:
    text = load(args).model_dump_json(indent=2)
    print(re.sub(r"(://[^:/@\s\"]*:)[^@\s\"]+@", r"\1***@", text))  # no Redis password on screen
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from statetier.benchmarks.cli import main as bench_main  # the benchmarks import torch

    return int(bench_main(list(args.extra)) or 0)
