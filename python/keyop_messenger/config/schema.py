"""The configuration's shape: one dataclass per YAML section, with the 1.4 defaults.

Field names are the YAML key names. :class:`ConfigFields` is the whole document;
:class:`~keyop_messenger.config.Config` (in :mod:`.loading`) adds to it the ways to
build, export and validate it. ``SECTIONS`` and ``ITEM_LISTS`` map the field type
names (strings, as ``from __future__ import annotations`` leaves them) to the
dataclasses, for the builder and the type checks.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass, field

#: Default of ``hub.fed_client_offset_ttl`` (one week).
DEFAULT_FED_CLIENT_OFFSET_TTL = datetime.timedelta(hours=168)


def _default_name() -> str:
    """The OS host name, or ``""`` when it cannot be determined."""
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
        compaction_threshold_mb: Segment roll size in MiB (despite its name, it is the
            segment size); a value <= 0 means segments never roll, as in the original.
        offset_flush_interval_ms: Minimum time between offset-file writes of a local
            subscriber; 0 writes after every message (must be >= 0).
    """

    data_dir: str = ""
    sync_interval_ms: int = 0
    max_subscriber_lag_mb: int = 512
    compaction_threshold_mb: int = 256
    offset_flush_interval_ms: int = 0


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
class AllowedPeer:
    """One entry of ``hub.allowed_peers``: a peer allowed to connect to this hub.

    Attributes:
        name: Must equal the Subject Common Name of the peer's client certificate,
            byte for byte (required, unique within the list).
        subscribe: Channels this peer may receive from the hub; empty = any channel.
        publish: Channels this peer may send to the hub; empty = any channel.
    """

    name: str
    subscribe: list[str] = field(default_factory=list)
    publish: list[str] = field(default_factory=list)


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
        send_buffer_messages: Capacity of each client connection's outbound queue;
            messages are dropped with a warning when it is full (must be > 0).
        max_batch_bytes: Batch size target for outgoing binary messages and size
            limit per incoming record (must be > 0).
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
class ConfigFields:
    """The fields of :class:`~keyop_messenger.config.Config`: the whole YAML document.

    Attributes:
        name: Instance name: ``origin`` of locally published envelopes,
            ``instance_name`` in the federation handshake, used in logs. Defaults to
            the OS host name; must be non-empty and should equal the CN of
            ``tls.cert``.
        storage: The ``storage`` section.
        subscribers: The ``subscribers`` section.
        hub: The ``hub`` section.
        client: The ``client`` section.
        tls: The ``tls`` section.
        federation: The ``federation`` section.
        dedup: The ``dedup`` section.
        audit: The ``audit`` section.
        metrics: The ``metrics`` section.
    """

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


SECTIONS: dict[str, type] = {
    "StorageConfig": StorageConfig,
    "SubscribersConfig": SubscribersConfig,
    "HubConfig": HubConfig,
    "ClientConfig": ClientConfig,
    "TLSConfig": TLSConfig,
    "FederationConfig": FederationConfig,
    "DedupConfig": DedupConfig,
    "AuditConfig": AuditConfig,
    "MetricsConfig": MetricsConfig,
}
ITEM_LISTS: dict[str, type] = {
    "list[AllowedPeer]": AllowedPeer,
    "list[HubEndpoint]": HubEndpoint,
}
