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
from .errors import (
    ClosedError,
    ConfigError,
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
from .subscription import Subscription

__all__ = [
    "AllowedPeer",
    "AuditConfig",
    "ClientConfig",
    "ClosedError",
    "Config",
    "ConfigError",
    "DedupConfig",
    "FederationConfig",
    "FederationError",
    "HubConfig",
    "HubEndpoint",
    "InvalidNameError",
    "KeyopError",
    "LogEntry",
    "Message",
    "MessageTooLargeError",
    "Messenger",
    "PayloadTypeError",
    "StorageConfig",
    "StorageError",
    "SubscribersConfig",
    "Subscription",
    "SubscriptionError",
    "TLSConfig",
    "__version__",
    "context",
    "load_config",
    "read_channel",
]
