"""keyop-messenger: fast, small, durable and federated pub/sub with a Rust engine."""

from ._core import __version__
from .config import (
    AllowedPeer,
    AuditConfig,
    ClientConfig,
    Config,
    DedupConfig,
    FederationConfig,
    HubConfig,
    HubEndpoint,
    StorageConfig,
    SubscribersConfig,
    TLSConfig,
    load_config,
)
from .context import context
from .ephemeral import EphemeralMessenger
from .errors import (
    BufferFullError,
    CertificateError,
    ClosedError,
    ConfigError,
    ConnectionLostError,
    FederationError,
    InvalidNameError,
    KeyopError,
    MessageTooLargeError,
    PayloadTypeError,
    StorageError,
    SubscriptionError,
)
from .message import LogEntry, Message
from .messenger import Messenger, read_channel
from .stats import (
    ChannelStats,
    FederationStats,
    HubLinkStats,
    HubListenerStats,
    LatencyStats,
    Stats,
    SubscriberStats,
    Totals,
)
from .subscription import Subscription

__all__ = [
    "AllowedPeer",
    "AuditConfig",
    "BufferFullError",
    "CertificateError",
    "ChannelStats",
    "ClientConfig",
    "ClosedError",
    "Config",
    "ConfigError",
    "ConnectionLostError",
    "DedupConfig",
    "EphemeralMessenger",
    "FederationConfig",
    "FederationError",
    "FederationStats",
    "HubConfig",
    "HubEndpoint",
    "HubLinkStats",
    "HubListenerStats",
    "InvalidNameError",
    "KeyopError",
    "LatencyStats",
    "LogEntry",
    "Message",
    "MessageTooLargeError",
    "Messenger",
    "PayloadTypeError",
    "Stats",
    "StorageConfig",
    "StorageError",
    "SubscriberStats",
    "SubscribersConfig",
    "Subscription",
    "SubscriptionError",
    "TLSConfig",
    "Totals",
    "__version__",
    "context",
    "load_config",
    "read_channel",
]
