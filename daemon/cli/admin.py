"""The admin commands: ``stats``, ``ls``, ``inspect``, ``verify``, ``purge``.

Each opens one frame connection (``statetier.clients.transport.connect``: no torch, no shared
memory), makes its call through ``statetier.clients.admin`` (what the SDK's admin methods
send too) and prints the answer: ``run_stats`` a table, ``run_ls`` one row per (tenant,
namespace), ``run_inspect`` the header with readable times, ``run_verify`` the report after
a progress bar that follows the daemon (on a terminal only: ``progress.py``), ``run_purge``
the counts — or, without ``--yes``, what it would remove, and nothing removed.

Arguments are checked before anything is asked: ``inspect`` takes a state id of 32 hex
digits (``deadbeef`` is not an id, whatever is stored); ``purge --namespace`` takes the hex
digest ``ls`` shows, or a prefix of it as ``ls`` and the connector's log abbreviate it (one
namespace must start with it: none is ``NotFound``, several an ``InvalidRequest`` naming
them). A daemon that is not there (no socket, connection refused) is said as such, with how
to start one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import string
import sys
from collections.abc import Awaitable, Callable

from statetier.clients import admin
from statetier.clients.endpoint import parse_url
from statetier.clients.transport import Connection, connect
from statetier.protocol.errors import Forbidden, InvalidRequest, NotFound, Unavailable
from statetier.protocol.identity import NAMESPACE_BYTES, STATE_ID_BYTES

from .formatting import format_bytes, format_listing, format_stats, readable_inspect
from .progress import TerminalProgress

_NOBODY_THERE = (ConnectionRefusedError, FileNotFoundError)  # no socket file, or nobody listening


def over_connection(args: argparse.Namespace, work: Callable[[Connection], Awaitable[object]]):
    async def session():
        try:
            conn = await connect(args.url, tenant=args.tenant, token=args.token, shm=False,
                                 client_name="statetier-cli")
        except Unavailable as exc:
            if isinstance(exc.__cause__, _NOBODY_THERE):
                raise Unavailable(no_daemon_message(args.url)) from exc
            raise
        try:
            return await work(conn)
        finally:
            await conn.close()

    return asyncio.run(session())


def no_daemon_message(url: str) -> str:
    return (f"no daemon at {parse_url(url)}: start one with `statetier serve` or `make run`, or point --url "
            f"(or $STATETIER_URL) at the one running")


def run_stats(args: argparse.Namespace) -> int:
    stats = over_connection(args, admin.stats)
    print(json.dumps(stats, indent=2, sort_keys=True, default=str) if args.json else format_stats(stats))
    return 0


def run_ls(args: argparse.Namespace) -> int:
    listing = over_connection(args, lambda conn: admin.list_objects(conn, all_tenants=args.all))
    print(json.dumps(listing, indent=2, sort_keys=True) if args.json else format_listing(listing))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    if not is_hex(args.state_id, STATE_ID_BYTES):
        raise InvalidRequest(f"{args.state_id!r} is not a state id: one is {2 * STATE_ID_BYTES} hex digits (the "
                             f"newest of each namespace are listed by `statetier ls`)")
    described = over_connection(args, lambda conn: admin.inspect(conn, args.state_id))
    print(json.dumps(described if args.json else readable_inspect(described), indent=2, sort_keys=True, default=str))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    progress = TerminalProgress("verify", unit="obj")
    try:
        report = over_connection(args, lambda conn: admin.verify(conn, progress))
    finally:
        progress.close()
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    return 0


def run_purge(args: argparse.Namespace) -> int:
    if args.namespace is not None:
        args.namespace = _whole_namespace(args)
    if not args.yes:
        return _show_what_purge_would_remove(args)
    report = over_connection(args, lambda conn: admin.purge(conn, args.namespace, tenant=args.of_tenant))
    tiers = ", ".join(f"{name} {count}" for name, count in report.get("by_tier", {}).items()) or "none"
    print(f"purged {report['objects']} objects ({format_bytes(report['bytes'])}) of {report['namespaces']} "
          f"namespace(s); copies removed per tier: {tiers}")
    if report.get("unavailable"):
        print(f"warning: tiers {', '.join(report['unavailable'])} did not answer: purge again once they do",
              file=sys.stderr)
        return 2
    return 0


def is_hex(text: str, nbytes: int | None = None) -> bool:
    """``text`` is hex digits (``nbytes`` of them, when given), and nothing else."""
    if not text or any(c not in string.hexdigits for c in text):
        return False
    return len(text) % 2 == 0 if nbytes is None else len(text) == 2 * nbytes


def _whole_namespace(args: argparse.Namespace) -> str:
    """The namespace ``--namespace`` names: its whole digest, or the one stored namespace
    that starts with the prefix given (``ls`` and the connector's log abbreviate it with ``…``)."""
    given = args.namespace.strip().rstrip("….").lower()
    if not given or any(c not in string.hexdigits for c in given) or len(given) > 2 * NAMESPACE_BYTES:
        raise InvalidRequest(f"{args.namespace!r} is not a namespace: one is up to {2 * NAMESPACE_BYTES} hex digits, "
                             f"as `statetier ls` shows it")
    if len(given) == 2 * NAMESPACE_BYTES:
        return given
    found = sorted({row["namespace"] for row in _visible(args)["namespaces"]
                    if (row.get("namespace") or "").startswith(given)})
    if not found:
        raise NotFound(f"no stored namespace starts with {given!r} (`statetier ls` shows what is stored)")
    if len(found) > 1:
        starts = ", ".join(n[:16] + "…" for n in found)
        raise InvalidRequest(f"{given!r} is the start of {len(found)} namespaces ({starts}): give more of it")
    return found[0]


def _visible(args: argparse.Namespace) -> dict:
    """Every namespace this connection may purge: every tenant's for an operator, else its own."""
    async def everything_visible(conn: Connection) -> dict:
        try:
            return await admin.list_objects(conn, all_tenants=True)
        except Forbidden:  # not an operator: its own tenant's is all it may purge anyway
            return await admin.list_objects(conn)

    return over_connection(args, everything_visible)


def _show_what_purge_would_remove(args: argparse.Namespace) -> int:
    listing = _visible(args)
    rows = [row for row in listing["namespaces"]
            if (args.namespace and row["namespace"] == args.namespace.lower())
            or (args.of_tenant and row["tenant"] == args.of_tenant)]
    if not rows:
        raise NotFound("nothing stored that this connection may see matches: nothing to purge "
                       "(`statetier ls` shows what is stored)")
    print(format_listing({"namespaces": rows}))
    print("nothing was removed: run again with --yes to remove these objects from every tier", file=sys.stderr)
    return 0
