"""The ``statetier`` command line: ``main(argv=None) -> int`` (``sys.exit`` only in ``__main__``).

Subcommands:

- ``serve``   — load the config (file ← env ← flags) and run the daemon (``daemon.app.run``)
- ``config``  — print the effective, validated configuration as JSON and exit
- ``stats``   — the daemon's tier usage as a table (``--json`` for the raw reply)
- ``inspect STATE_ID`` — the sealed header of one object and the tiers holding it
- ``verify``  — re-check every stored object; dropped objects are counted by reason
- ``keygen``  — write a new keyring (``--out``), its public trust store (``--public-out``),
                or rotate an existing one (``--rotate FILE``); files are mode 0600
- ``bench``   — run the benchmark suite (``statetier.benchmarks.cli.main``)

Client commands take ``--url`` (default ``$STATETIER_URL`` or ``unix://./statetier.sock``).
A statetier error prints ``error: <reason>: <message>`` on stderr and exits with 2.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from pathlib import Path

from statetier.protocol.errors import ConfigError, InvalidRequest, StatetierError

from .config_loading import client_url_from_env, load_config, parse_setting

EXIT_ERROR = 2

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    try:
        return int(args.run(args) or 0)
    except StatetierError as exc:
        print(f"error: {exc.reason}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:  # the process edge: a socket or file problem nothing translated
        print(f"error: unavailable: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statetier", description="Tiered offload daemon for KV pages and SSM snapshots.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub)
    _add_config(sub)
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--url", default=client_url_from_env(), help="daemon address: unix://PATH or tcp://HOST:PORT")

    stats = sub.add_parser("stats", parents=[client], help="tier usage and daemon counters")
    stats.add_argument("--json", action="store_true", help="print the raw reply as JSON")
    stats.set_defaults(run=_run_stats)

    insp = sub.add_parser("inspect", parents=[client], help="header and tiers of one stored object")
    insp.add_argument("state_id", metavar="STATE_ID", help="32 hex digits")
    insp.set_defaults(run=_run_inspect)

    verify = sub.add_parser("verify", parents=[client], help="re-check every stored object")
    verify.set_defaults(run=_run_verify)

    _add_keygen(sub)

    bench = sub.add_parser("bench", parents=[client], help="run the benchmarks")
    bench.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    bench.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    bench.add_argument("extra", nargs=argparse.REMAINDER, help="passed on to the benchmark runner")
    bench.set_defaults(run=_run_bench)
    return parser


def _add_config_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", type=Path, help="TOML config file (default $STATETIER_CONFIG)")
    parser.add_argument("--socket", metavar="PATH", help="Unix socket path (listen.socket_path)")
    parser.add_argument("--tcp", metavar="HOST:PORT", help="also listen on TCP (listen.tcp)")
    parser.add_argument("--disk-dir", metavar="DIR", help="disk tier directory (disk.directory)")
    parser.add_argument("--redis-url", metavar="URL", help="Redis tier URL (redis.url)")
    parser.add_argument("--metrics-host", metavar="ADDR", help="metrics bind address (metrics.host)")
    parser.add_argument("--metrics-port", metavar="PORT", type=int, help="metrics port (metrics.port)")
    parser.add_argument("--no-metrics", action="store_true", help="no metrics HTTP server (metrics.enabled=false)")
    parser.add_argument("--host-capacity", metavar="SIZE", help="host arena size, e.g. 8GiB (host.capacity_bytes)")
    parser.add_argument("--device", metavar="DEVICE", help="enable the device tier on DEVICE, e.g. cuda:0")
    parser.add_argument("--keyring", metavar="FILE", help="signing keyring file (keys.keyring_file)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error", "critical"])
    parser.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[],
        help="any config field by dotted key, value as in the environment (JSON or text); repeatable",
    )


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    _add_config_source(serve)
    serve.set_defaults(run=_run_serve)


def _add_config(sub) -> None:
    config = sub.add_parser("config", help="print the effective configuration as JSON")
    _add_config_source(config)
    config.set_defaults(run=_run_config)


def _add_keygen(sub) -> None:
    keygen = sub.add_parser("keygen", help="create or rotate a signing keyring")
    target = keygen.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", metavar="FILE", type=Path, help="write a new keyring to FILE")
    target.add_argument("--rotate", metavar="FILE", type=Path, help="rotate the keyring in FILE (in place)")
    keygen.add_argument("--alg", choices=["hmac-sha256", "ed25519"], default=None,
                        help="key algorithm (new keyring: hmac-sha256; rotation: the current one)")
    keygen.add_argument("--public-out", metavar="FILE", type=Path, help="also write the ed25519 trust store (public keys)")
    keygen.add_argument("--grace-seconds", type=float, default=86400.0,
                        help="with --rotate: how long the old key still verifies (default one day)")
    keygen.add_argument("--force", action="store_true", help="overwrite existing files")
    keygen.set_defaults(run=_run_keygen)


# -- serve / config ---------------------------------------------------------------------


def config_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The serve flags as dotted config overrides (flags left unset are absent)."""
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


def _load(args: argparse.Namespace):
    return load_config(args.config, overrides=config_overrides(args))


def _run_serve(args: argparse.Namespace) -> int:
    config = _load(args)
    from .app import run  # lazy: the composition root imports every tier

    return run(config)


def _run_config(args: argparse.Namespace) -> int:
    text = _load(args).model_dump_json(indent=2)
    print(re.sub(r"(://[^:/@\s\"]*:)[^@\s\"]+@", r"\1***@", text))  # no Redis password on screen
    return 0


# -- client commands --------------------------------------------------------------------


def _connect(url: str):
    from statetier.clients import Client  # lazy: keeps `statetier keygen` free of the client

    return Client(url)


def _run_stats(args: argparse.Namespace) -> int:
    with _connect(args.url) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True, default=str))
    else:
        print(format_stats(stats))
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    try:
        bytes.fromhex(args.state_id)
    except ValueError:
        raise InvalidRequest(f"STATE_ID must be hex, got {args.state_id!r}") from None
    with _connect(args.url) as client:
        described = client.inspect(args.state_id)
    print(json.dumps(described, indent=2, sort_keys=True, default=str))
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    progress = _Progress()
    with _connect(args.url) as client:
        try:
            if "progress" in inspect.signature(client.verify).parameters:
                report = client.verify(progress=progress)
            else:
                progress.waiting()
                report = client.verify()
        finally:
            progress.close()
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    return 0


class _Progress:
    """A tqdm bar when tqdm is installed, else one rewritten stderr line."""

    def __init__(self) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=0, unit="obj", desc="verify", file=sys.stderr)

    def __call__(self, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = done
            self._bar.refresh()
        else:
            print(f"\rverify: {done}/{total}", end="", file=sys.stderr, flush=True)

    def waiting(self) -> None:
        if self._bar is None:
            print("verify: checking every stored object…", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


def format_stats(stats: dict) -> str:
    """The STATS reply as a table of tiers followed by the daemon-wide numbers."""
    columns = ("tier", "objects", "used", "capacity", "use", "leases", "inflight", "evictions", "compactions")
    rows = [columns]
    for tier in stats.get("tiers") or []:
        used, capacity = int(tier.get("bytes_used", 0)), int(tier.get("capacity", 0))
        rows.append((
            str(tier.get("tier", "?")), str(tier.get("objects", 0)), format_bytes(used), format_bytes(capacity),
            f"{100 * used / capacity:.1f}%" if capacity else "-", str(tier.get("leases", 0)),
            str(tier.get("inflight", 0)), str(tier.get("evictions", 0)), str(tier.get("compactions_run", 0)),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    for key in sorted(k for k in stats if k != "tiers"):
        value = stats[key]
        if isinstance(value, dict) and value:
            lines.append(f"{key}:")
            lines.extend(f"  {sub}: {_scalar(value[sub])}" for sub in sorted(value))
        else:
            lines.append(f"{key}: {_scalar(value)}")
    return "\n".join(lines)


def _scalar(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else str(value)


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# -- keygen -----------------------------------------------------------------------------


def _run_keygen(args: argparse.Namespace) -> int:
    from statetier.protocol.keyring import Keyring, SigAlg

    alg = SigAlg.from_label(args.alg) if args.alg else None
    if args.rotate is not None:
        keyring = Keyring.load(args.rotate)
        old = keyring.active
        new = keyring.rotate(grace_seconds=args.grace_seconds, alg=alg)
        path = args.rotate
        _save(keyring, path)
        print(f"rotated {path}: active key {new.key_id.hex()} ({new.alg.label}); "
              f"{old.key_id.hex()} verifies for {args.grace_seconds:g} s more")
    else:
        path = args.out
        _refuse_overwrite(path, args.force)
        keyring = Keyring.generate(alg or SigAlg.HMAC_SHA256)
        _save(keyring, path)
        print(f"wrote {path}: key {keyring.active.key_id.hex()} ({keyring.active.alg.label}), mode 0600")
    if args.public_out is not None:
        if keyring.active.alg is not SigAlg.ED25519:
            raise ConfigError("--public-out needs ed25519 keys; an HMAC key has no public half")
        _refuse_overwrite(args.public_out, args.force)
        _save(keyring.trust_store(), args.public_out)
        print(f"wrote {args.public_out}: trust store with {len(keyring.trust_store().keys)} public key(s)")
    return 0


def _refuse_overwrite(path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise ConfigError(f"{path} exists; pass --force to overwrite it")


def _save(keyring, path: Path) -> None:
    try:
        keyring.save(path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from exc


# -- bench ------------------------------------------------------------------------------


def _run_bench(args: argparse.Namespace) -> int:
    from statetier.benchmarks.cli import main as bench_main  # lazy: the benchmarks import torch

    argv = ["--url", args.url]
    if args.quick:
        argv.append("--quick")
    if args.json:
        argv += ["--json", args.json]
    return int(bench_main(argv + list(args.extra)) or 0)
