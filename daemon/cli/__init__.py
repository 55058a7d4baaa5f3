"""The ``statetier`` command line: ``main(argv=None) -> int`` (``sys.exit`` only in ``__main__``).

``build_parser()`` describes every subcommand with argparse alone; a command's module is
imported only when it runs, so ``statetier --help`` and the admin commands load neither
torch nor the tiers (``tests/daemon/test_cli_admin.py`` checks what they import):

- ``serve``, ``config`` — ``serve.py``: the configuration (file ← environment ← flags; a
  ``statetier.toml`` in the current folder is read when neither ``--config`` nor
  ``$STATETIER_CONFIG`` names a file, and said so), then the daemon or its effective config
- ``keygen`` — ``keys.py``: a new keyring, its trust store, or a rotation (files 0600)
- ``stats``, ``ls``, ``inspect``, ``verify``, ``purge`` — ``admin.py``: one frame connection
  (``statetier.clients.transport``), tables with readable sizes and times (``formatting.py``)
- ``lookup`` — ``lookup.py``: the joint hit of a token file under a model's layers, layer by layer
- ``bench`` — ``statetier.benchmarks.cli``: every argument after ``bench`` is its own, ``--help``
  included (one help, listing the suites; ``--url`` defaults to a private daemon there)
- ``completion`` — ``completion.py``: a bash, zsh or tcsh completion script (shtab)
- ``--version`` — the release

Client commands take ``--url`` (default ``$STATETIER_URL`` or ``unix://./statetier.sock``).
A statetier error prints ``error: <reason>: <message>`` on stderr and exits with 2; no daemon
at the address says so, and how to start one (``admin.no_daemon_message``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from statetier.daemon.client_env import client_token_from_env, client_url_from_env

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left
EXIT_ERROR = 2
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]


def main(argv: list[str] | None = None) -> int:
    from statetier.protocol.errors import StatetierError

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark runner parses its own arguments: one help, one --url default
        args = argparse.Namespace(command="bench", run="serve:run_bench", extra=argv[1:])
    else:
        args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    module, _, function = args.run.partition(":")
    try:
        run = getattr(importlib.import_module(f"{__name__}.{module}"), function)
        code = int(run(args) or 0)
        sys.stdout.flush()  # here, so that a closed pipe is met inside this try
        return code
    except BrokenPipeError:  # `statetier stats --json | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return EXIT_BROKEN_PIPE
    except StatetierError as exc:
        print(f"error: {exc.reason}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:  # the process edge: a socket or file problem nothing translated
        print(f"error: unavailable: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    from statetier import __version__

    parser = argparse.ArgumentParser(prog="statetier",
                                     description="Tiered offload daemon for KV pages and SSM snapshots.")
    parser.add_argument("--version", action="version", version=f"statetier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    _add_config_source(serve)
    serve.set_defaults(run="serve:run_serve")
    config = sub.add_parser("config", help="print the effective configuration as JSON")
    _add_config_source(config)
    config.set_defaults(run="serve:run_config")
    _add_admin(sub)
    _add_lookup(sub)
    _add_keygen(sub)
    bench = sub.add_parser("bench", add_help=False,
                           help="run the benchmarks (statetier bench --help: its suites and options)")
    bench.add_argument("extra", nargs=argparse.REMAINDER, help="the benchmark runner's arguments")
    bench.set_defaults(run="serve:run_bench")
    completion = sub.add_parser("completion", help="print a shell completion script (bash, zsh, tcsh)")
    completion.add_argument("shell", choices=["bash", "zsh", "tcsh"])
    completion.set_defaults(run="completion:run_completion")
    return parser


def _client_options() -> argparse.ArgumentParser:
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--url", default=client_url_from_env(),
                        help="daemon address: unix://PATH or tcp://HOST:PORT (default $STATETIER_URL, "
                             "else %(default)s)")
    client.add_argument("--tenant", default="default", help="the tenant to act as (default: %(default)s)")
    client.add_argument("--token", default=client_token_from_env(),
                        help="bearer token of the tenant (default $STATETIER_TOKEN)")
    return client


def _add_admin(sub) -> None:
    client = _client_options()
    stats = sub.add_parser("stats", parents=[client], help="tier usage and daemon counters")
    stats.add_argument("--json", action="store_true", help="print the raw reply as JSON")
    stats.set_defaults(run="admin:run_stats")

    ls = sub.add_parser("ls", parents=[client], help="what is stored, per tenant and namespace")
    ls.add_argument("--all", action="store_true", help="every tenant's (an operator: listen.operator_uids)")
    ls.add_argument("--json", action="store_true", help="print the raw reply as JSON")
    ls.set_defaults(run="admin:run_ls")

    insp = sub.add_parser("inspect", parents=[client], help="header and tiers of one stored object")
    insp.add_argument("state_id", metavar="STATE_ID", help="32 hex digits")
    insp.add_argument("--json", action="store_true", help="print the raw reply (times in ns since the epoch)")
    insp.set_defaults(run="admin:run_inspect")

    verify = sub.add_parser("verify", parents=[client], help="re-check every stored object")
    verify.set_defaults(run="admin:run_verify")

    purge = sub.add_parser("purge", parents=[client],
                           help="remove a namespace's (or a tenant's) objects from every tier, Redis included")
    target = purge.add_mutually_exclusive_group(required=True)
    target.add_argument("--namespace", metavar="HEX", help="the namespace digest, as `statetier ls` shows it")
    target.add_argument("--of-tenant", metavar="NAME",
                        help="every namespace of this tenant (yours, or any for an operator)")
    purge.add_argument("--yes", action="store_true", help="do it (without --yes: say what would be removed)")
    purge.set_defaults(run="admin:run_purge")


def _add_lookup(sub) -> None:
    lookup = sub.add_parser("lookup", parents=[_client_options()],
                            help="the joint hit of a token file under a model's layers, layer by layer")
    lookup.add_argument("--tokens", metavar="FILE", required=True,
                        help="token ids: a JSON list, or integers separated by spaces or commas")
    lookup.add_argument("--model", metavar="FILE", required=True,
                        help="a lookup spec (JSON: namespace, attention_layers, ssm_layers, block_size, …) or a "
                             "Hugging Face config.json (its layers read with transformers)")
    lookup.add_argument("--namespace", metavar="HEX", help="the namespace digest (`statetier ls`), when the model "
                                                           "file does not give one")
    lookup.add_argument("--block-size", type=int, help="tokens per KV block (default: the spec's, else 16)")
    lookup.add_argument("--kv-layout", choices=["prefix", "blocks"], help="one KV page [0, N) per boundary "
                        "(the transformers adapter), or one per block (the vLLM connector; default: the spec's, "
                        "else prefix)")
    lookup.add_argument("--json", action="store_true", help="print the result as JSON")
    lookup.set_defaults(run="lookup:run_lookup")


def _add_keygen(sub) -> None:
    keygen = sub.add_parser("keygen", help="create or rotate a signing keyring")
    target = keygen.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", metavar="FILE", help="write a new keyring to FILE")
    target.add_argument("--rotate", metavar="FILE", help="rotate the keyring in FILE (in place)")
    keygen.add_argument("--alg", choices=["hmac-sha256", "ed25519"], default=None,
                        help="key algorithm (new keyring: hmac-sha256; rotation: the current one)")
    keygen.add_argument("--public-out", metavar="FILE", help="also write the ed25519 trust store (public keys)")
    keygen.add_argument("--grace-seconds", type=float, default=86400.0,
                        help="with --rotate: how long the old key still verifies (default one day)")
    keygen.add_argument("--force", action="store_true", help="overwrite existing files")
    keygen.set_defaults(run="keys:run_keygen")


def _add_config_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", type=Path, help="TOML config file (default $STATETIER_CONFIG, else "
                                                         "./statetier.toml when there is one)")
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
    parser.add_argument("--log-level", choices=LOG_LEVELS)
    parser.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[],
        help="any config field by dotted key, value as in the environment (JSON or text; file modes octal); repeatable",
    )
