"""The configuration's shape: one dataclass per YAML section, with the 1.4 defaults.

Field names are the YAML key names. :class:`ConfigFields` is the whole document;
:class:`~keyop_messenger.config.Config` (in :mod:`.loading`) adds to it the ways to
build, export and validate it. ``SECTIONS`` and ``ITEM_LISTS`` map the field type
names (strings, as ``from __future__ import annotations`` leaves them) to the
dataclasses, for the builder and the type checks.
"""

from __future__ import annotations

import datetime
import logging
import warnings
from dataclasses import dataclass, field

#: Default of ``hub.fed_client_offset_ttl`` (one week).
DEFAULT_FED_CLIENT_OFFSET_TTL = datetime.timedelta(hours=168)
#: Default of ``storage.segment_size_mb``.
DEFAULT_SEGMENT_SIZE_MB = 256


def _default_name() -> str:
    """The OS host name, or ``""`` when it cannot be determined."""
    import socket  # only when ``name`` is left out; socket costs ~0.5 MB of RSS

    try:
        return socket.gethostname()
    except OSError:
        return ""


@dataclass
class StorageConfig:
    """The ``storage`` section: where and how messages are written to disk.

    Attributes:
        data_dir: Root of the on-disk layout; required, there is no default.
        sync_interval_ms: 0 fsyncs every append before publish returns; N > 0 fsyncs
            the active segment every N ms instead (must be >= 0).
        max_subscriber_lag_mb: Lag (MiB) above which compaction logs a per-subscriber
            warning every 30 s; a value <= 0 disables the warning.
        segment_size_mb: Segment roll size in MiB (default 256); a value <= 0 means
            segments never roll. It deletes nothing: see the ``retention`` section.
        compaction_threshold_mb: Deprecated name of ``segment_size_mb`` (the 1.4 key;
            despite its name it is only the segment size). Still accepted, with a
            ``DeprecationWarning`` and a logged warning; setting both is an error. Read
            as 1.4 reads it: 0 means the default (256), a negative value never rolls.
        offset_flush_interval_ms: Minimum time between offset-file writes of a local
            subscriber; 0 writes after every batch of deliveries (one message, or
            many on a backlog; must be >= 0).
    """

    data_dir: str = ""
    sync_interval_ms: int = 0
    max_subscriber_lag_mb: int = 512
    segment_size_mb: int | None = None
    compaction_threshold_mb: int | None = None
    offset_flush_interval_ms: int = 0

    def __post_init__(self) -> None:
        if self.compaction_threshold_mb is not None:
            text = (
                "storage.compaction_threshold_mb is deprecated: it is the segment size; "
                "name it storage.segment_size_mb"
            )
            warnings.warn(text, DeprecationWarning, stacklevel=3)
            logging.getLogger("keyop_messenger").warning("%s", text)

    def segment_mb(self) -> int:
        """The segment size in MiB: ``segment_size_mb``, else the deprecated
        ``compaction_threshold_mb`` (where 0 means the default, as in 1.4, whose
        files may hold an explicit 0), else 256."""
        if self.segment_size_mb is not None:
            return self.segment_size_mb
        if self.compaction_threshold_mb:
            return self.compaction_threshold_mb
        return DEFAULT_SEGMENT_SIZE_MB


@dataclass
class SubscribersConfig:
    """The ``subscribers`` section: local subscriber behaviour.

    Attributes:
        max_retries: Retries after the first failed handler call before the message is
            dead-lettered; YAML ``null`` or absent means 5, an explicit 0 dead-letters
            after the first failure (must be >= 0).
        offset_ttl: New in this implementation (not a 1.4 key): offset files of
            subscribers that have not subscribed in this process and whose file is
            older than this are removed by the retention pass (logged), so they stop
            holding back segment deletion. Zero or negative (default) keeps them forever.
    """

    max_retries: int = 5
    offset_ttl: datetime.timedelta = datetime.timedelta(0)


@dataclass
class RetentionChannel:
    """One entry of ``retention.channels``: the limits of one channel.

    The entry replaces both global limits for that channel; a limit it leaves out
    (or sets to 0) is off for it.

    Attributes:
        name: The channel (required, unique within the list; ``.dead-letter``
            channels included).
        max_age: Delete sealed segments last written longer ago than this, read or
            not. 0 (default): off.
        max_bytes: Delete the oldest sealed segments while the channel holds more
            than this many bytes, read or not. 0 (default): off.
    """

    name: str
    max_age: datetime.timedelta = datetime.timedelta(0)
    max_bytes: int = 0


@dataclass
class RetentionConfig:
    """The ``retention`` section (new in this implementation, not a 1.4 key): when
    data is deleted.

    Without it, a sealed segment is deleted only once every offset file of its
    channel (local subscribers, also ones not subscribed since a restart, and
    federation cursors) is past it, and a channel with no offset file keeps all
    its data (1.4 deleted it). The active segment is never deleted. The limits
    below delete data whether it was read or not; a subscriber whose unread data
    went gets ``on_gap`` and a logged warning.

    Attributes:
        max_age: Delete sealed segments last written longer ago than this. 0
            (default): off.
        max_bytes: Delete the oldest sealed segments while a channel holds more
            than this many bytes (the active segment counts but stays). 0
            (default): off.
        channels: Per-channel limits, each replacing both global limits for its
            channel.
    """

    max_age: datetime.timedelta = datetime.timedelta(0)
    max_bytes: int = 0
    channels: list[RetentionChannel] = field(default_factory=list)


@dataclass
class AllowedPeer:
    """One entry of ``hub.allowed_peers``: a peer allowed to connect to this hub.

    Attributes:
        name: Must equal the Subject Common Name of the peer's client certificate,
            byte for byte (required, unique within the list).
        subscribe: Channels this peer may receive from the hub; empty = any channel.
        publish: Channels this peer may send to the hub; empty = any channel.
        max_channels: Most channels this peer's messages may create on the hub
            (channels that did not exist yet), counted since the hub started;
            further new channels are refused (reason ``channel_limit``: the
            publisher hears it). Default 1024; 0 lets the peer create none.
    """

    name: str
    subscribe: list[str] = field(default_factory=list)
    publish: list[str] = field(default_factory=list)
    max_channels: int = 1024


@dataclass
class HubConfig:
    """The ``hub`` section: accepting federation connections from other instances.

    Attributes:
        enabled: Start the federation listener (requires ``listen_addr`` and the TLS
            certificate, key and CA).
        listen_addr: TCP ``host:port`` to listen on (port 0 picks a free port).
        allowed_peers: Peers allowed to connect; anyone else (everyone, if the list is
            empty) is rejected.
        fed_client_offset_ttl: Age (by modification time) after which a ``fed-*.offset``
            file is deleted by the hub's sweep; a negative duration disables the sweep.
            A zero duration in YAML means the default (168h), as in the original.
    """

    enabled: bool = False
    listen_addr: str = ""
    allowed_peers: list[AllowedPeer] = field(default_factory=list)
    fed_client_offset_ttl: datetime.timedelta = DEFAULT_FED_CLIENT_OFFSET_TTL


@dataclass
class HubEndpoint:
    """One entry of ``client.hubs``: a hub this instance dials.

    Attributes:
        addr: ``host:port`` to dial; the host is also checked against the hub
            certificate's DNS SANs (required when ``client.enabled``).
        subscribe: Channels requested from this hub; also the receive filter for
            envelopes coming from it. Empty = request nothing (and accept anything).
        publish: Locally published channels forwarded to this hub; empty = forward
            nothing.
    """

    addr: str
    subscribe: list[str] = field(default_factory=list)
    publish: list[str] = field(default_factory=list)


@dataclass
class ClientConfig:
    """The ``client`` section: outbound federation connections to hubs.

    Attributes:
        enabled: Dial every entry of ``hubs`` at startup (requires at least one hub).
        hubs: One outbound connection per entry; duplicates become independent
            connections.
    """

    enabled: bool = False
    hubs: list[HubEndpoint] = field(default_factory=list)


@dataclass
class TLSConfig:
    """The ``tls`` section: certificate material for federation.

    Attributes:
        cert: Path of this instance's PEM certificate (leaf first); requires ``key``
            and ``ca``. Required by an enabled hub or client: federation is
            always TLS, never plain ``ws://``.
        key: Path of the PEM private key; requires ``cert``.
        ca: Path of the PEM file of CA certificates trusted for both roles.
        min_version: ``"1.2"`` or ``"1.3"``; checked but ignored at runtime (TLS 1.3
            is always required).
        expiry_warn_days: At startup, warn if the certificate or the first CA
            certificate expires within this many days (must be >= 0).
    """

    cert: str = ""
    key: str = ""
    ca: str = ""
    min_version: str = "1.3"
    expiry_warn_days: int = 30


@dataclass
class FederationConfig:
    """The ``federation`` section: tuning of federation connections.

    Attributes:
        reconnect_base_ms: First reconnect delay and its reset value (must be > 0).
        reconnect_max_ms: Cap of the doubling reconnect delay (must be >=
            ``reconnect_base_ms``).
        reconnect_jitter: Relative jitter applied as a uniform factor in [-j, +j]
            (must be within [0, 1]; 0 disables jitter).
        send_buffer_messages: Publishes an ephemeral client queues while it is
            not connected; one past it raises ``BufferFullError`` (must be > 0).
            Durable clients forward from their data directory and need no queue:
            the key has no effect on them.
        max_batch_bytes: Batch size target for outgoing binary messages (a record
            larger than it still goes, alone, up to the 10 MiB record limit); an
            incoming WebSocket message may be up to this + 10 MiB + 64 KiB
            (must be > 0).
    """

    reconnect_base_ms: int = 500
    reconnect_max_ms: int = 60000
    reconnect_jitter: float = 0.2
    send_buffer_messages: int = 10000
    max_batch_bytes: int = 4194304


@dataclass
class DedupConfig:
    """The ``dedup`` section: duplicate message suppression.

    Attributes:
        seen_id_lru_size: Capacity of the in-memory set of recently seen message ids
            (must be > 0).
    """

    seen_id_lru_size: int = 100000


@dataclass
class AuditConfig:
    """The ``audit`` section: rotation of the audit log ``audit.jsonl``.

    Attributes:
        max_size_mb: Rotate ``audit.jsonl`` when it reaches this size in MiB (must be > 0).
        max_files: Number of rotated audit files kept (must be > 0).
    """

    max_size_mb: int = 100
    max_files: int = 10


@dataclass
class MetricsConfig:
    """The ``metrics`` section (new in this implementation, not a 1.4 key).

    Attributes:
        listen_addr: ``host:port`` where ``GET /metrics`` serves ``Messenger.stats()``
            in the Prometheus text format (an empty host listens on every interface;
            port 0 picks a free port, see ``Messenger.metrics_address``). Empty
            (default): no metrics listener.
    """

    listen_addr: str = ""


@dataclass
class GatewayToken:
    """One entry of ``gateway.tokens``: a bearer token for programs without a
    client certificate.

    Attributes:
        name: A label for logs and the rate limit (required, unique within the list).
        hash: ``sha256:`` and the hex SHA-256 of the token, as printed by
            ``keyop-messenger token create NAME``; the token itself is never stored.
        publish: Channels the token may publish to; empty = none.
        subscribe: Channels the token may read; empty = none.
    """

    name: str
    hash: str = ""
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)


@dataclass
class GatewayConfig:
    """The ``gateway`` section (new in this implementation): publish and subscribe
    over HTTPS (see docs/gateway.md).

    It serves with the instance's ``tls`` files. A client presents a client
    certificate issued by the CA, whose CN must be in ``hub.allowed_peers`` (its
    publish/subscribe lists apply, empty = any channel), or a bearer token of
    ``tokens``.

    Attributes:
        enabled: Start the gateway (requires ``listen_addr`` and the ``tls`` files).
        listen_addr: TCP ``host:port`` to listen on (port 0 picks a free port,
            see ``Messenger.gateway_address``).
        tokens: Bearer tokens, stored as hashes.
        max_body_bytes: Largest request body; larger ones get 413 (must be > 0).
        rate_limit_per_s: Requests per second per client (certificate or token);
            more get 429 with Retry-After. 0 switches the limit off (must be >= 0).
        rate_limit_burst: Requests a client may make at once before the rate
            applies (must be > 0).
        max_streams: Most event streams, long polls and WebSockets open at once;
            more get 503 with Retry-After (must be > 0).
        max_connections: Most connections open at once; more wait in the
            listen backlog (must be > 0).
        header_timeout: Time a client has to finish the TLS handshake and send
            a request's headers (must be > 0).
        idle_timeout: A connection that moves no byte either way for this long
            is closed (must be > 0).
        max_wait: Longest wait of a long poll (must be > 0).
    """

    enabled: bool = False
    listen_addr: str = ""
    tokens: list[GatewayToken] = field(default_factory=list)
    max_body_bytes: int = 1048576
    rate_limit_per_s: float = 100.0
    rate_limit_burst: int = 200
    max_streams: int = 256
    max_connections: int = 1024
    header_timeout: datetime.timedelta = datetime.timedelta(seconds=10)
    idle_timeout: datetime.timedelta = datetime.timedelta(seconds=60)
    max_wait: datetime.timedelta = datetime.timedelta(seconds=30)


@dataclass
class LogConfig:
    """The ``log`` section (new in this implementation, not a 1.4 key).

    Attributes:
        level: ``debug``, ``info``, ``warning`` or ``error``: the level of the
            ``keyop_messenger`` loggers under ``keyop-messenger run`` (``-v`` and
            ``-q`` override it; read again on SIGHUP). Empty (default): ``info``.
            An application embedding a Messenger configures logging itself; the
            key does not change it.
    """

    level: str = ""


@dataclass
class ConfigFields:
    """The fields of :class:`~keyop_messenger.config.Config`, the whole YAML
    document: ``name`` and one attribute per section (documented on ``Config``,
    which adds loading and validation)."""

    name: str = field(default_factory=_default_name)
    storage: StorageConfig = field(default_factory=StorageConfig)
    subscribers: SubscribersConfig = field(default_factory=SubscribersConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)


SECTIONS: dict[str, type] = {
    "StorageConfig": StorageConfig,
    "LogConfig": LogConfig,
    "SubscribersConfig": SubscribersConfig,
    "HubConfig": HubConfig,
    "ClientConfig": ClientConfig,
    "TLSConfig": TLSConfig,
    "FederationConfig": FederationConfig,
    "DedupConfig": DedupConfig,
    "AuditConfig": AuditConfig,
    "MetricsConfig": MetricsConfig,
    "RetentionConfig": RetentionConfig,
    "GatewayConfig": GatewayConfig,
}
ITEM_LISTS: dict[str, type] = {
    "list[AllowedPeer]": AllowedPeer,
    "list[HubEndpoint]": HubEndpoint,
    "list[RetentionChannel]": RetentionChannel,
    "list[GatewayToken]": GatewayToken,
}
