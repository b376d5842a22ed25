"""``keyop-messenger stats``: channels, subscribers and their lag."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from .common import CONFIG_HELP, Out, check_data_dir, load, ops_command, rfc3339, table


def add_parsers(commands: Any) -> None:
    """Adds ``stats`` to the subcommands ``commands``."""
    stats = ops_command(
        commands,
        "stats",
        _cmd_stats,
        help="show channels, subscribers and their lag",
        description="Reads the data directory's files (no lock: it works beside a "
        "running messenger) and prints per channel its size and per subscriber its lag. "
        "Counters, latencies and federation live in the running process: it serves them "
        "on metrics.listen_addr (/metrics, /status); here they are zero.",
    )
    stats.add_argument("--config", required=True, metavar="F", help=CONFIG_HELP)
    stats.add_argument("--json", action="store_true", help="print the snapshot as JSON")


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return rfc3339(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _cmd_stats(args: argparse.Namespace) -> int:
    from .. import _core
    from ..stats import stats_from_engine

    data_dir = Path(load(args.config).storage.data_dir)
    check_data_dir(data_dir)
    stats = stats_from_engine(_core.read_stats(str(data_dir)))
    out = Out()
    if args.json:
        out.line(json.dumps(dataclasses.asdict(stats), default=_json_default, indent=2))
        return 0
    t = stats.totals
    rows: list[list[Any]] = [["CHANNEL", "STREAM BYTES", "DISK BYTES", "SUBSCRIBERS", "MAX LAG"]]
    for c in stats.channels:
        max_lag = max((s.lag_bytes for s in c.subscribers), default=0)
        rows.append([c.name, c.stream_bytes, c.disk_bytes, len(c.subscribers), max_lag])
    noun = "channel" if t.channels == 1 else "channels"
    rows.append([f"total ({t.channels} {noun})", t.stream_bytes, t.disk_bytes, t.subscribers, ""])
    for text in table(rows, {1, 2, 3, 4}):
        out.line(text)
    subs = [(c.name, s) for c in stats.channels for s in c.subscribers]
    if subs:
        out.line("")
        rows = [["CHANNEL", "SUBSCRIBER", "LAG BYTES", "OLDEST PENDING", "STATE"]]
        for name, s in subs:
            pending = rfc3339(s.oldest_pending) if s.oldest_pending else "-"
            rows.append([name, s.id, s.lag_bytes, pending, "active" if s.active else "idle"])
        for text in table(rows, {2}):
            out.line(text)
    fed = stats.federation
    if fed.links:
        out.line("")
        rows = [["HUB", "CONNECTED", "RECONNECTS", "UNACKED BYTES", "RTT P50 MS", "RTT P99 MS"]]
        for link in fed.links:
            rows.append(
                [
                    link.addr,
                    "yes" if link.connected else "no",
                    link.reconnects,
                    link.unacked_bytes,
                    f"{link.rtt_p50_us / 1000:.2f}",
                    f"{link.rtt_p99_us / 1000:.2f}",
                ]
            )
        for text in table(rows, {2, 3, 4, 5}):
            out.line(text)
    if fed.listener is not None:
        lst = fed.listener
        out.line("")
        out.line(
            f"hub {lst.listen_addr}: {len(lst.peers)} peers, {lst.records_received} "
            f"records received, {lst.connections_accepted} connections accepted, "
            f"{lst.connections_rejected} rejected"
        )
    return 0
