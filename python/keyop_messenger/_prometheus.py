"""The Prometheus text exposition format (version 0.0.4) of a
:class:`~keyop_messenger.stats.Stats` snapshot: what :mod:`keyop_messenger.metrics`
and its HTTP listener (:mod:`keyop_messenger._metrics_http`) both use. The
families are listed in :mod:`keyop_messenger.metrics`."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Protocol

from .stats import GatewayStats, HubLinkStats, HubListenerStats, Stats

__all__ = ["CONTENT_TYPE", "StatsSource", "log", "render"]

log = logging.getLogger("keyop_messenger")

#: Content type of the Prometheus text format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_QUANTILES = (("0.5", "p50_us"), ("0.9", "p90_us"), ("0.99", "p99_us"))
_RTT_QUANTILES = (("0.5", "rtt_p50_us"), ("0.99", "rtt_p99_us"))

_Labels = tuple[tuple[str, str], ...]



def _escape_label(value: str) -> str:
    r"""A label value as the text format wants it: ``\``, ``"`` and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    """A sample value: integers without a fraction, ``NaN``/``+Inf``/``-Inf`` spelled out."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class _Writer:
    """Accumulates families: HELP and TYPE once, then the samples."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self, name: str, kind: str, help_text: str, samples: Iterable[tuple[_Labels, float]]
    ) -> None:
        """Writes one family; one written with no sample still gets HELP/TYPE."""
        self._lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if labels:
                text = ",".join(f'{key}="{_escape_label(val)}"' for key, val in labels)
                self._lines.append(f"{name}{{{text}}} {_number(value)}")
            else:
                self._lines.append(f"{name} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def render(stats: Stats) -> str:
    """``stats`` in the Prometheus text exposition format (ends with a newline)."""
    out = _Writer()
    channels = stats.channels
    out.family(
        "keyop_messages_published_total",
        "counter",
        "Records appended to the channel since the messenger opened (local, batch and federated).",
        [((("channel", c.name),), c.messages_published) for c in channels],
    )
    out.family(
        "keyop_stream_bytes",
        "gauge",
        "Stream end of the channel: the global byte offset the next record gets.",
        [((("channel", c.name),), c.stream_bytes) for c in channels],
    )
    out.family(
        "keyop_disk_bytes",
        "gauge",
        "Bytes of the channel's segment files on disk.",
        [((("channel", c.name),), c.disk_bytes) for c in channels],
    )
    subs = [(c.name, s) for c in channels for s in c.subscribers]
    out.family(
        "keyop_subscriber_lag_bytes",
        "gauge",
        "Bytes between the subscriber's position and the stream end.",
        [((("channel", ch), ("subscriber", s.id)), s.lag_bytes) for ch, s in subs],
    )
    out.family(
        "keyop_subscriber_oldest_pending_timestamp_seconds",
        "gauge",
        "Publish time (Unix seconds) of the oldest message the subscriber has not "
        "acknowledged; absent when nothing is pending.",
        (
            ((("channel", ch), ("subscriber", s.id)), s.oldest_pending.timestamp())
            for ch, s in subs
            if s.oldest_pending is not None
        ),
    )
    out.family(
        "keyop_subscriber_active",
        "gauge",
        "1 if the subscriber is subscribed in this process, or is a federation cursor whose "
        "link is connected, 0 if only its offset file exists.",
        [((("channel", ch), ("subscriber", s.id)), int(s.active)) for ch, s in subs],
    )
    out.family(
        "keyop_channels",
        "gauge",
        "Channels in the data directory.",
        [((), stats.totals.channels)],
    )
    loss = stats.data_loss
    out.family(
        "keyop_data_loss_total",
        "counter",
        "Data loss readers met in this process, by kind: gap (a reader's position "
        "pointed into bytes that were gone) or quarantined (an unreadable record "
        "copied aside and passed over).",
        [((("kind", "gap"),), loss.gaps), ((("kind", "quarantined"),), loss.quarantined)],
    )
    out.family(
        "keyop_data_loss_bytes_total",
        "counter",
        "Bytes in the gaps readers met in this process.",
        [((), loss.gap_bytes)],
    )
    stages = sorted(stats.latency.items())
    out.family(
        "keyop_latency_seconds",
        "gauge",
        "Latency quantiles over a sliding window of recent samples, per stage: publish "
        "(append to commit), consume (commit to handler start), handler (run time).",
        (
            ((("stage", stage), ("quantile", q)), getattr(lat, attr) / 1e6)
            for stage, lat in stages
            if lat.count > 0
            for q, attr in _QUANTILES
        ),
    )
    out.family(
        "keyop_latency_samples",
        "gauge",
        "Samples in the latency window, per stage.",
        [((("stage", stage),), lat.count) for stage, lat in stages],
    )
    links = stats.federation.links
    if links:
        _link_families(out, links)
    listener = stats.federation.listener
    if listener is not None:
        _listener_families(out, listener)
    if stats.gateway is not None:
        _gateway_families(out, stats.gateway)
    return out.text()


def _gateway_families(out: _Writer, gw: GatewayStats) -> None:
    out.family(
        "keyop_gateway_requests_total", "counter", "HTTP requests to the gateway.",
        [((), gw.requests)],
    )  # fmt: skip
    out.family(
        "keyop_gateway_published_total", "counter", "Messages committed through the gateway.",
        [((), gw.published)],
    )  # fmt: skip
    out.family(
        "keyop_gateway_delivered_total", "counter",
        "Messages sent to gateway clients (SSE, long polls, WebSockets).",
        [((), gw.delivered)],
    )  # fmt: skip
    out.family(
        "keyop_gateway_streams_open", "gauge", "Gateway streams open now.",
        [((), gw.streams_open)],
    )  # fmt: skip
    out.family(
        "keyop_gateway_refused_total", "counter",
        "Gateway requests refused (or connections closed), by reason.",
        [((("reason", reason),), n) for reason, n in sorted(gw.refused.items())],
    )  # fmt: skip


def _link_families(out: _Writer, links: list[HubLinkStats]) -> None:
    out.family(
        "keyop_federation_link_connected",
        "gauge",
        "1 while the link to the hub is connected.",
        [((("hub", link.addr),), int(link.connected)) for link in links],
    )
    out.family(
        "keyop_federation_link_reconnects_total",
        "counter",
        "Successful reconnects of the link to the hub (the first connection not counted).",
        [((("hub", link.addr),), link.reconnects) for link in links],
    )
    out.family(
        "keyop_federation_link_unacked_bytes",
        "gauge",
        "Bytes sent to the hub and not yet acknowledged.",
        [((("hub", link.addr),), link.unacked_bytes) for link in links],
    )
    out.family(
        "keyop_federation_refused_total",
        "counter",
        "Messages the hub refused (policy, size, validity, channel limit), per channel;"
        " they stay in this instance's channel files.",
        [
            ((("hub", link.addr), ("channel", channel)), n)
            for link in links
            for channel, n in sorted(link.refused.items())
        ],
    )
    out.family(
        "keyop_federation_link_refused_channel",
        "gauge",
        "1 for each channel this instance forwards that the hub's handshake refuses: its "
        "records are not sent and stay in this instance's channel files until the hub "
        "allows it.",
        [
            ((("hub", link.addr), ("channel", channel)), 1)
            for link in links
            for channel in sorted(set(link.refused_channels))
        ],
    )
    out.family(
        "keyop_federation_link_rtt_seconds",
        "gauge",
        "Round trip from sending a batch to the hub to its acknowledgement (quantiles).",
        (
            ((("hub", link.addr), ("quantile", q)), getattr(link, attr) / 1e6)
            for link in links
            for q, attr in _RTT_QUANTILES
        ),
    )


def _listener_families(out: _Writer, listener: HubListenerStats) -> None:
    out.family(
        "keyop_hub_peers",
        "gauge",
        "Peers connected to the hub listener.",
        [((), len(listener.peers))],
    )
    out.family(
        "keyop_hub_peer_connected",
        "gauge",
        "1 for each peer connected to the hub listener.",
        [((("peer", name),), 1) for name in sorted(set(listener.peers))],
    )
    out.family(
        "keyop_hub_records_received_total",
        "counter",
        "Records received from peers by the hub listener.",
        [((), listener.records_received)],
    )
    out.family(
        "keyop_hub_connections_accepted_total",
        "counter",
        "Peer connections accepted by the hub listener.",
        [((), listener.connections_accepted)],
    )
    out.family(
        "keyop_hub_connections_rejected_total",
        "counter",
        "Connections the hub listener rejected because their certificate's name is not "
        "in allowed_peers.",
        [((), listener.connections_rejected)],
    )
    out.family(
        "keyop_hub_connections_failed_total",
        "counter",
        "Connections that ended before their handshake completed, by stage: tls, "
        "websocket, handshake, timeout, evicted (dropped unfinished for newer ones).",
        [((("stage", stage),), n) for stage, n in listener.connections_failed.items()],
    )
    out.family(
        "keyop_hub_records_refused_total",
        "counter",
        "Records from peers the hub listener refused (never stored nor acknowledged as "
        "stored), by reason: policy, too_large, invalid, channel_limit.",
        [((("reason", reason),), n) for reason, n in listener.records_refused.items()],
    )


class StatsSource(Protocol):
    """Anything with a ``stats()`` method, e.g. a :class:`~keyop_messenger.Messenger`."""

    def stats(self) -> Stats: ...
