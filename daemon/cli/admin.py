"""The admin commands: ``stats``, ``ls``, ``inspect``, ``verify``, ``purge``.

Each opens one frame connection (``statetier.clients.transport.connect``: no torch, no shared
memory), makes its call through ``statetier.clients.admin`` (what the SDK's admin methods
send too) and prints the answer: ``run_stats`` a table, ``run_ls`` one row per (tenant,
namespace), ``run_inspect`` the header with readable times, ``run_verify`` the report after
a progress line that follows the daemon, ``run_purge`` the counts — or, without ``--yes``,
what it would remove, and nothing removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable

from statetier.clients import admin
from statetier.clients.transport import Connection, connect
from statetier.protocol.errors import Forbidden, InvalidRequest, NotFound

from .formatting import format_bytes, format_listing, format_stats, readable_inspect


def over_connection(args: argparse.Namespace, work: Callable[[Connection], Awaitable[object]]):
    async def session():
        conn = await connect(args.url, tenant=args.tenant, token=args.token, shm=False, client_name="statetier-cli")
        try:
            return await work(conn)
        finally:
            await conn.close()

    return asyncio.run(session())


def run_stats(args: argparse.Namespace) -> int:
    stats = over_connection(args, admin.stats)
    print(json.dumps(stats, indent=2, sort_keys=True, default=str) if args.json else format_stats(stats))
    return 0


def run_ls(args: argparse.Namespace) -> int:
    listing = over_connection(args, lambda conn: admin.list_objects(conn, all_tenants=args.all))
    print(json.dumps(listing, indent=2, sort_keys=True) if args.json else format_listing(listing))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    try:
        bytes.fromhex(args.state_id)
    except ValueError:
        raise InvalidRequest(f"STATE_ID must be hex, got {args.state_id!r}") from None
    described = over_connection(args, lambda conn: admin.inspect(conn, args.state_id))
    print(json.dumps(described if args.json else readable_inspect(described), indent=2, sort_keys=True, default=str))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    progress = _Progress()
    try:
        report = over_connection(args, lambda conn: admin.verify(conn, progress))
    finally:
        progress.close()
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    return 0


def run_purge(args: argparse.Namespace) -> int:
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


def _show_what_purge_would_remove(args: argparse.Namespace) -> int:
    async def everything_visible(conn: Connection) -> dict:
        try:
            return await admin.list_objects(conn, all_tenants=True)
        except Forbidden:  # not an operator: its own tenant's is all it may purge anyway
            return await admin.list_objects(conn)

    listing = over_connection(args, everything_visible)
    rows = [row for row in listing["namespaces"]
            if (args.namespace and row["namespace"] == args.namespace.lower())
            or (args.of_tenant and row["tenant"] == args.of_tenant)]
    if not rows:
        raise NotFound("nothing stored that this connection may see matches: nothing to purge "
                       "(`statetier ls` shows what is stored)")
    print(format_listing({"namespaces": rows}))
    print("nothing was removed: run again with --yes to remove these objects from every tier", file=sys.stderr)
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

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)
