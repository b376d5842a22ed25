"""keyop-messenger: fast, small, durable and federated pub/sub with a Rust engine.

Every log record of the package, the Rust engine's included (bridged with
pyo3-log as ``keyop_messenger.keyop_core.<module>``), comes from a logger under
``keyop_messenger``; the package adds only a ``NullHandler`` there, so the
application decides where records go (``keyop-messenger run`` sets up stderr).
"""

import importlib as _importlib
import logging as _logging
from typing import TYPE_CHECKING, Any

from ._core import Receipt, __version__
from .config import (
    AllowedPeer,
    AuditConfig,
    ClientConfig,
    Config,
    DedupConfig,
    FederationConfig,
    GatewayConfig,
    GatewayToken,
    HubConfig,
    HubEndpoint,
    MetricsConfig,
    StorageConfig,
    SubscribersConfig,
    TLSConfig,
    load_config,
)
from .context import context, current_context
from .errors import (
    BufferFullError,
    CertificateError,
    ChannelNotFoundError,
    ClosedError,
    ConfigError,
    ConnectionLostError,
    DataDirLockedError,
    DataDirNotFoundError,
    DataLossError,
    FederationError,
    ForkedProcessError,
    InvalidNameError,
    KeyopError,
    KeyopTimeoutError,
    MessageTooLargeError,
    MetricsError,
    PayloadTypeError,
    PolicyError,
    StorageError,
    SubscriptionError,
)
from .message import LogEntry, Message
from .messenger import Messenger
from .payloads import PayloadRegistry
from .positions import Position
from .reading import read_channel
from .subscription import DeadLetter, Handler, Subscription

_logging.getLogger("keyop_messenger").addHandler(_logging.NullHandler())

__all__ = [
    "AllowedPeer",
    "AsyncEphemeralMessenger",
    "AsyncMessenger",
    "AsyncSubscription",
    "AuditConfig",
    "BufferFullError",
    "CertificateError",
    "ChannelNotFoundError",
    "ChannelStats",
    "ClientConfig",
    "ClosedError",
    "Config",
    "ConfigError",
    "ConnectionLostError",
    "DataDirLockedError",
    "DataDirNotFoundError",
    "DataLossError",
    "DeadLetter",
    "DedupConfig",
    "EphemeralMessenger",
    "FederationConfig",
    "FederationError",
    "FederationStats",
    "FederationStatus",
    "ForkedProcessError",
    "GatewayConfig",
    "GatewayToken",
    "Handler",
    "HubConfig",
    "HubEndpoint",
    "HubLinkStats",
    "HubLinkStatus",
    "HubListenerStats",
    "HubStatus",
    "InvalidNameError",
    "KeyopError",
    "KeyopTimeoutError",
    "LatencyStats",
    "LogEntry",
    "Message",
    "MessageStream",
    "MessageTooLargeError",
    "Messenger",
    "MetricsConfig",
    "MetricsError",
    "PayloadRegistry",
    "PayloadTypeError",
    "PolicyError",
    "Position",
    "Receipt",
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
    "current_context",
    "load_config",
    "read_channel",
]

if TYPE_CHECKING:
    from .aio import AsyncEphemeralMessenger, AsyncMessenger, AsyncSubscription, MessageStream
    from .ephemeral import EphemeralMessenger
    from .stats import (
        ChannelStats,
        FederationStats,
        FederationStatus,
        HubLinkStats,
        HubLinkStatus,
        HubListenerStats,
        HubStatus,
        LatencyStats,
        Stats,
        SubscriberStats,
        Totals,
    )

# Names whose module loads on first use (PEP 562), so that ``import keyop_messenger``
# stays small for a publisher on a small board (idle memory, docs/performance.md): the asyncio
# classes (asyncio pulls in ssl), the ephemeral client and the stats snapshot types
# (returned by ``stats()`` / ``federation_status()``, which import them themselves).
# tests/test_import_footprint.py checks that these modules stay unimported.
_LAZY = {
    "AsyncEphemeralMessenger": "aio",
    "AsyncMessenger": "aio",
    "AsyncSubscription": "aio",
    "MessageStream": "aio",
    "EphemeralMessenger": "ephemeral",
    "ChannelStats": "stats",
    "FederationStats": "stats",
    "FederationStatus": "stats",
    "HubLinkStats": "stats",
    "HubLinkStatus": "stats",
    "HubListenerStats": "stats",
    "HubStatus": "stats",
    "LatencyStats": "stats",
    "Stats": "stats",
    "SubscriberStats": "stats",
    "Totals": "stats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    namespace = globals()
    namespace[name] = getattr(_importlib.import_module(f".{module}", __name__), name)
    return namespace[name]  # stored: later look-ups skip __getattr__


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
