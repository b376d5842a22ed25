"""Configuration of a keyop-messenger instance.

The configuration is a YAML document with the same keys as the original Go
implementation (keyop-messenger 1.4). Each YAML section maps onto one
dataclass below, whose field names are the YAML key names and whose defaults
are the original's defaults.

Two ways to get a :class:`Config`:

* ``load_config(path)`` reads a YAML file (safe loading; a key given twice is an error) and calls
  :meth:`Config.from_dict`;
* build the dataclasses in code, e.g.
  ``Config(storage=StorageConfig(data_dir="/var/lib/keyop"))``, and call
  :meth:`Config.validate` (``Messenger`` also calls ``validate()`` on the
  configuration it is given, so a bad configuration never reaches the engine).

Validation collects **every** problem and raises one
:class:`~keyop_messenger.errors.ConfigError` whose ``problems`` list has one
entry per problem, each starting with the dotted key it is about, e.g.
``storage.data_dir: required``.

Differences from the original, on purpose:

* Unknown keys are reported instead of silently ignored (the original accepted
  and ignored, for example, ``storage.max_segment_bytes``).
* Values of the wrong type are reported. A boolean is not accepted where an
  integer is expected; an integer is accepted where a float is expected.
* An explicit value is always honoured and checked; only an absent key or a
  YAML ``null`` takes the default. (The original replaced every zero value by
  the default, so e.g. ``reconnect_jitter: 0`` meant 0.2; here it means no
  jitter, and ``reconnect_base_ms: 0`` is an error.) The single exception is
  ``hub.fed_client_offset_ttl``: a zero duration read by ``from_dict`` is
  replaced by the default 168h, exactly as in the original.
* ``name: ""`` is reported as an empty name instead of being replaced by the
  host name; leave the key out (or set it to ``null``) to use the host name.
* A few checks the original lacked are performed: offset flush interval and
  expiry warning days must be >= 0, the federation numbers must be positive
  with ``reconnect_max_ms >= reconnect_base_ms``, addresses must look like
  ``host:port``, an enabled hub needs ``listen_addr`` and the TLS files, an
  enabled client needs at least one hub and the TLS files (the original
  dialed plain ``ws://`` without them; federation here is always TLS),
  ``tls.ca`` is required whenever ``tls.cert`` is set, and peer names in
  ``hub.allowed_peers`` must be non-empty and unique.
* ``tls.min_version`` written as an unquoted YAML number (``1.2`` or ``1.3``)
  is accepted and stored as the string ``"1.2"`` / ``"1.3"``; any other
  number is reported.
"""

from .durations import format_duration, parse_duration
from .loading import Config, load_config
from .schema import (
    DEFAULT_FED_CLIENT_OFFSET_TTL,
    AllowedPeer,
    AuditConfig,
    ClientConfig,
    DedupConfig,
    FederationConfig,
    GatewayConfig,
    GatewayToken,
    HubConfig,
    HubEndpoint,
    LogConfig,
    MetricsConfig,
    RetentionChannel,
    RetentionConfig,
    StorageConfig,
    SubscribersConfig,
    TLSConfig,
)

__all__ = [
    "DEFAULT_FED_CLIENT_OFFSET_TTL",
    "AllowedPeer",
    "AuditConfig",
    "ClientConfig",
    "Config",
    "DedupConfig",
    "FederationConfig",
    "GatewayConfig",
    "GatewayToken",
    "HubConfig",
    "HubEndpoint",
    "LogConfig",
    "MetricsConfig",
    "RetentionChannel",
    "RetentionConfig",
    "StorageConfig",
    "SubscribersConfig",
    "TLSConfig",
    "format_duration",
    "load_config",
    "parse_duration",
]
