"""Typed snapshots of a messenger's counters (``Messenger.stats()``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ChannelStats",
    "DataLossStats",
    "FederationStats",
    "FederationStatus",
    "HubLinkStats",
    "HubLinkStatus",
    "HubListenerStats",
    "HubStatus",
    "LatencyStats",
    "Stats",
    "SubscriberStats",
    "Totals",
    "federation_status_from_engine",
    "stats_from_engine",
]


@dataclass(frozen=True)
class SubscriberStats:
    """One local subscriber (or federation cursor) of a channel."""

    id: str
    """Subscriber id (``fed-<peer>`` / ``hub-<addr>`` for federation cursors)."""
    lag_bytes: int
    """Stream end minus the subscriber's position."""
    oldest_pending: datetime.datetime | None
    """Publish time of the oldest message not yet acknowledged, if any."""
    active: bool
    """Whether it is subscribed in this process, or is a federation cursor whose peer
    or hub link is connected now (else: only its offset file exists)."""


@dataclass(frozen=True)
class ChannelStats:
    """One channel of the data directory."""

    name: str
    messages_published: int
    """Records appended since this messenger opened: local publishes, batches,
    federated records and, on a ``.dead-letter`` channel, its dead letters."""
    stream_bytes: int
    """Stream end: global offset the next record gets."""
    disk_bytes: int
    """Bytes of the segment files currently on disk."""
    subscribers: list[SubscriberStats] = field(default_factory=list)
    last_message: datetime.datetime | None = None
    """Publish time of the newest record, if the channel holds any."""


@dataclass(frozen=True)
class Totals:
    """Sums over every channel."""

    channels: int
    messages_published: int
    stream_bytes: int
    disk_bytes: int
    subscribers: int


@dataclass(frozen=True)
class LatencyStats:
    """Percentiles (microseconds) over a sliding window of recent samples."""

    count: int
    """Samples in the window."""
    p50_us: float
    p90_us: float
    p99_us: float


@dataclass(frozen=True)
class HubLinkStats:
    """This instance's link to one hub (client role)."""

    addr: str
    connected: bool
    reconnects: int
    unacked_bytes: int
    """Bytes sent in the batch awaiting acknowledgement."""
    rtt_p50_us: float
    """Batch send -> acknowledgement round trip."""
    rtt_p99_us: float
    refused: dict[str, int] = field(default_factory=dict)
    """Records the hub refused, per channel, since this messenger started
    (policy, size or validity). They stay in this instance's channel files."""
    refused_channels: list[str] = field(default_factory=list)
    """Configured ``publish`` channels the hub's handshake says it refuses:
    not sent (their cursor stays, so they go out once the hub allows them)."""


@dataclass(frozen=True)
class HubListenerStats:
    """The hub listener (hub role)."""

    listen_addr: str
    peers: list[str]
    """Peers connected now."""
    records_received: int
    """Records stored from peers."""
    connections_accepted: int
    connections_rejected: int
    """Connections whose certificate's name is not in ``hub.allowed_peers``."""
    records_refused: dict[str, int] = field(default_factory=dict)
    """Records refused, per reason: ``policy``, ``too_large``, ``invalid``,
    ``channel_limit`` (every reason listed, zeros included)."""
    connections_failed: dict[str, int] = field(default_factory=dict)
    """Connections that ended before their handshake completed, per stage:
    ``tls``, ``websocket``, ``handshake``, ``timeout`` (10 s) and ``evicted``
    (dropped unfinished to make room for newer ones); every stage listed."""


@dataclass(frozen=True)
class FederationStats:
    """Federation state; empty when federation is off."""

    links: list[HubLinkStats] = field(default_factory=list)
    listener: HubListenerStats | None = None


@dataclass(frozen=True)
class DataLossStats:
    """Data loss seen by readers in this process (all messengers and
    ``read_channel`` calls together)."""

    gaps: int = 0
    """Times a reader's position pointed into bytes that were gone (deleted by
    retention, a removed or truncated segment); each is logged (WARNING)."""
    gap_bytes: int = 0
    """Bytes in those gaps."""
    quarantined: int = 0
    """Unreadable records copied to ``<data_dir>/quarantine/<channel>/`` and
    passed over (each counted once)."""


@dataclass(frozen=True)
class GatewayStats:
    """The HTTP gateway's counters since it started (``gateway`` section)."""

    requests: int = 0
    published: int = 0
    """Messages committed through the gateway."""
    delivered: int = 0
    """Messages sent to clients (SSE, long polls, WebSockets)."""
    streams_open: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    """Refusals by reason: ``unauthenticated`` (401), ``forbidden`` (403),
    ``too_large`` (413), ``rate_limited`` (429), ``too_many_streams`` (503, or 429
    for one client's share), ``too_many_auth_failures`` (429: an address sent too
    many bad tokens), ``bad_request`` (400, 404, 405, 426, WebSocket protocol
    errors), ``timed_out`` (header or idle timeout), ``too_many_connections`` (an
    unfinished connection dropped to make room), ``tls`` (a failed TLS handshake)
    and ``storage`` (500: the record could not be stored, e.g. a full disk)."""


@dataclass(frozen=True)
class Stats:
    """A snapshot (not atomic across channels) of a messenger."""

    channels: list[ChannelStats]
    totals: Totals
    latency: dict[str, LatencyStats]
    """Per stage: ``publish`` (append to commit), ``consume`` (commit to handler
    start) and ``handler`` (handler run time, per batch of messages)."""
    federation: FederationStats
    data_loss: DataLossStats = field(default_factory=DataLossStats)
    """Gaps and quarantined records (exported as ``keyop_data_loss_total``)."""
    gateway: GatewayStats | None = None
    """The HTTP gateway's counters; None when it is not running."""


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def _at(nanos: int | None) -> datetime.datetime | None:
    if nanos is None:
        return None
    return _EPOCH + datetime.timedelta(microseconds=nanos // 1000)


def stats_from_engine(raw: dict[str, Any]) -> Stats:
    """Builds :class:`Stats` from the engine's ``stats()`` dictionary."""
    channels = [
        ChannelStats(
            name=c["name"],
            messages_published=c["messages_published"],
            stream_bytes=c["stream_bytes"],
            disk_bytes=c["disk_bytes"],
            subscribers=[
                SubscriberStats(id=i, lag_bytes=lag, oldest_pending=_at(ns), active=active)
                for i, lag, ns, active in c["subscribers"]
            ],
            last_message=_at(c.get("last_message_nanos")),
        )
        for c in raw["channels"]
    ]
    totals = Totals(
        channels=len(channels),
        messages_published=sum(c.messages_published for c in channels),
        stream_bytes=sum(c.stream_bytes for c in channels),
        disk_bytes=sum(c.disk_bytes for c in channels),
        subscribers=sum(len(c.subscribers) for c in channels),
    )
    latency = {
        stage: LatencyStats(count=n, p50_us=p50, p90_us=p90, p99_us=p99)
        for stage, (n, p50, p90, p99) in raw["latency"].items()
    }
    listener = raw["listener"]
    federation = FederationStats(
        links=[
            HubLinkStats(
                addr=a,
                connected=c,
                reconnects=r,
                unacked_bytes=u,
                rtt_p50_us=p50,
                rtt_p99_us=p99,
                refused=dict(refused),
                refused_channels=list(refused_channels),
            )
            for a, c, r, u, p50, p99, refused, refused_channels in raw["links"]
        ],
        listener=None
        if listener is None
        else HubListenerStats(
            listen_addr=listener[0],
            peers=list(listener[1]),
            records_received=listener[2],
            connections_accepted=listener[3],
            connections_rejected=listener[4],
            records_refused=dict(listener[5]),
            connections_failed=dict(listener[6]),
        ),
    )
    gaps, gap_bytes, quarantined = raw.get("data_loss", (0, 0, 0))
    gateway = None
    if raw.get("gateway") is not None:
        counters = dict(raw["gateway"])
        gateway = GatewayStats(
            requests=counters.pop("requests"),
            published=counters.pop("published"),
            delivered=counters.pop("delivered"),
            streams_open=counters.pop("streams_open"),
            refused={k.removeprefix("refused_"): v for k, v in counters.items()},
        )
    return Stats(
        channels=channels,
        totals=totals,
        latency=latency,
        federation=federation,
        data_loss=DataLossStats(gaps=gaps, gap_bytes=gap_bytes, quarantined=quarantined),
        gateway=gateway,
    )


@dataclass(frozen=True)
class HubStatus:
    """The hub of this instance (``Messenger.federation_status().hub``)."""

    accepted: int
    """Connections accepted since start."""
    rejected: int
    """Connections rejected (TLS, unknown peer, limits) since start."""
    peers: list[str]
    """Names of the peers connected now."""


@dataclass(frozen=True)
class HubLinkStatus:
    """One client link to a hub (``Messenger.federation_status().clients``)."""

    addr: str
    """The hub's ``host:port`` as configured."""
    connected: bool
    reconnects: int
    """Successful connections after the first."""
    failed_attempts: int
    """Dial attempts that failed since start."""
    refused: dict[str, int]
    """Records the hub refused, per channel (kept on this instance's disk)."""
    refused_channels: list[str]
    """Configured publish channels the hub's latest handshake refuses (not sent)."""
    refused_subscriptions: list[str]
    """Subscribed channels the hub will not deliver (latest handshake)."""


@dataclass(frozen=True)
class FederationStatus:
    """``Messenger.federation_status()``: the hub, if enabled, and every client link."""

    hub: HubStatus | None
    clients: list[HubLinkStatus] = field(default_factory=list)


def federation_status_from_engine(raw: dict[str, Any]) -> FederationStatus:
    """Builds :class:`FederationStatus` from the engine's plain snapshot."""
    hub = raw.get("hub")
    return FederationStatus(
        hub=None
        if hub is None
        else HubStatus(
            accepted=hub["accepted"], rejected=hub["rejected"], peers=list(hub["peers"])
        ),
        clients=[
            HubLinkStatus(
                addr=c["addr"],
                connected=c["connected"],
                reconnects=c["reconnects"],
                failed_attempts=c["failed_attempts"],
                refused=dict(c["refused"]),
                refused_channels=list(c["refused_channels"]),
                refused_subscriptions=list(c["refused_subscriptions"]),
            )
            for c in raw.get("clients", [])
        ],
    )
