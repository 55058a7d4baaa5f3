"""What the admin commands print: tables with readable sizes and times.

- ``format_bytes(n)`` — ``"3.0 MiB"``; ``format_time(ns, now_ns=None)`` — ``"2026-12-02 16:54:04 UTC
  (12 s ago)"`` from nanoseconds since the epoch.
- ``format_stats(reply)`` — the STATS reply as a table of tiers, what was served and refused
  (``format_counters``: hits and misses per tier and kind, rejections by reason, peer pulls,
  losses and fences, outage-served requests), then the daemon-wide numbers.
- ``format_listing(reply)`` — the LIST reply: one row per (tenant, namespace), its objects
  (each once) and copies (an object in host and disk: one object, two copies) apart.
- ``readable_inspect(reply)`` — the INSPECT reply with ``created_at`` beside ``created_at_ns``.
- ``table(rows)`` — columns aligned, the first left, the others right.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Sequence


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_time(ns: int | None, now_ns: int | None = None) -> str:
    if not ns:
        return "-"
    moment = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc)
    age = ((now_ns if now_ns is not None else time.time_ns()) - ns) / 1e9
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC ({_duration(age)})"


def _duration(seconds: float) -> str:
    if seconds < 0:
        return "in the future"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def format_stats(stats: dict) -> str:
    # per tier its copies: an object held in host and disk counts in both (`ls` counts objects)
    rows = [("tier", "copies", "used", "capacity", "use", "leases", "inflight", "evictions", "compactions")]
    for tier in stats.get("tiers") or []:
        used, capacity = int(tier.get("bytes_used", 0)), int(tier.get("capacity", 0))
        rows.append((
            str(tier.get("tier", "?")), str(tier.get("objects", 0)), format_bytes(used), format_bytes(capacity),
            f"{100 * used / capacity:.1f}%" if capacity else "-", str(tier.get("leases", 0)),
            str(tier.get("inflight", 0)), str(tier.get("evictions", 0)), str(tier.get("compactions_run", 0)),
        ))
    lines = table(rows)
    lines.append("(copies per tier: an object in two tiers counts in both; statetier ls counts each object once)")
    lines.extend(format_counters(stats.get("counters") or {}, stats.get("tiers") or [],
                                 stats.get("registry_heads_behind", 0)))
    for key in sorted(k for k in stats if k not in ("tiers", "counters")):
        value = stats[key]
        if isinstance(value, dict) and value:
            lines.append(f"{key}:")
            lines.extend(f"  {sub}: {_scalar(value[sub])}" for sub in sorted(value))
        else:
            lines.append(f"{key}: {_scalar(value)}")
    return "\n".join(lines)


def format_counters(counters: dict, tiers: list, heads_behind: int = 0) -> list[str]:
    """What was served and refused since the daemon started, one line each."""
    if not counters:
        return []
    hits = counters.get("hits") or {}
    lines = ["since start:",
             "  hits: " + (", ".join(f"{tier} {kind} {n}" for tier in sorted(hits) for kind, n in
                                     sorted(hits[tier].items())) or "none"),
             "  misses: " + _counts(counters.get("misses")),
             "  rejections: " + _counts(counters.get("rejections")),
             "  skipped candidates: " + _counts(counters.get("skipped_candidates"))]
    peer = next((t.get("extra") or {} for t in tiers if t.get("tier") == "peer"), None)
    if peer is not None:
        lines.append(f"  peers: pulls {peer.get('pulls', 0)}, lost {peer.get('pulls_lost', 0)}, owners fenced "
                     f"{peer.get('owners_fenced', 0)}, served {peer.get('served', 0)}, refused "
                     f"{peer.get('refused', 0)}")
    lines.append("  served while Redis was unreachable: " + _counts(counters.get("outage_served")))
    lines.append(f"  registry heads behind (fenced): {heads_behind}; busy: {counters.get('busy', 0)}; "
                 f"unpublished puts: {counters.get('unpublished_puts', 0)}")
    lines.append("  errors: " + _counts(counters.get("errors")))
    return lines


def _counts(by_label: dict | None) -> str:
    """``"bad_signature 2, stale 1"``: the non-zero counts, largest first; ``"none"``."""
    counted = sorted(((n, label) for label, n in (by_label or {}).items() if n), key=lambda c: (-c[0], c[1]))
    return ", ".join(f"{label} {n}" for n, label in counted) or "none"


def format_listing(reply: dict, now_ns: int | None = None) -> str:
    rows = [("tenant", "namespace", "objects", "copies", "bytes", "tiers (copies)", "kinds", "oldest", "newest")]
    for row in reply.get("namespaces") or []:
        tiers = ", ".join(f"{name} {on['objects']}" for name, on in row.get("tiers", {}).items())
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(row.get("kinds", {}).items()))
        copies = row.get("copies", sum(on["objects"] for on in row.get("tiers", {}).values()))
        rows.append((row.get("tenant") or "?", row.get("namespace") or "(not recorded)", str(row.get("objects", 0)),
                     str(copies), format_bytes(row.get("bytes", 0)), tiers, kinds,
                     format_time(row.get("oldest_ns"), now_ns), format_time(row.get("newest_ns"), now_ns)))
    lines = table(rows) if len(rows) > 1 else ["nothing stored (for this tenant)"]
    for row in reply.get("namespaces") or []:
        if row.get("newest_ids"):
            lines.append(f"newest in {(row.get('namespace') or '?')[:16]}…: {' '.join(row['newest_ids'])} "
                         f"(statetier inspect STATE_ID)")
    if reply.get("unavailable"):
        lines.append(f"not listed: tiers {', '.join(reply['unavailable'])} did not answer")
    return "\n".join(lines)


def readable_inspect(reply: dict, now_ns: int | None = None) -> dict:
    header = reply.get("header")
    if isinstance(header, dict) and "created_at_ns" in header:
        header = {**header, "created_at": format_time(header["created_at_ns"], now_ns)}
        return {**reply, "header": header}
    return reply


def _scalar(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else str(value)
