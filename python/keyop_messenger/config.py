"""Configuration of a keyop-messenger instance.

The configuration is a YAML document with the same keys as the original Go
implementation (keyop-messenger 1.4). Each YAML section maps onto one
dataclass below, whose field names are the YAML key names and whose defaults
are the original's defaults.

Two ways to get a :class:`Config`:

* ``load_config(path)`` reads a YAML file (with ``yaml.safe_load``) and calls
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

from __future__ import annotations

import datetime
import difflib
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import yaml

from .errors import ConfigError

__all__ = [
    "DEFAULT_FED_CLIENT_OFFSET_TTL",
    "AllowedPeer",
    "AuditConfig",
    "ClientConfig",
    "Config",
    "DedupConfig",
    "FederationConfig",
    "HubConfig",
    "HubEndpoint",
    "MetricsConfig",
    "StorageConfig",
    "SubscribersConfig",
    "TLSConfig",
    "format_duration",
    "load_config",
    "parse_duration",
]

#: Default of ``hub.fed_client_offset_ttl`` (one week).
DEFAULT_FED_CLIENT_OFFSET_TTL = datetime.timedelta(hours=168)


# ---------------------------------------------------------------------------
# Durations (Go ``time.ParseDuration`` / ``Duration.String`` syntax)
# ---------------------------------------------------------------------------

_NS_PER_UNIT: dict[str, int] = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign
    "\u03bcs": 1_000,  # Greek small letter mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60 * 1_000_000_000,
    "h": 3600 * 1_000_000_000,
}
_UNIT_PATTERN = "ns|us|\u00b5s|\u03bcs|ms|s|m|h"
_NUMBER_PATTERN = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_DURATION_RE = re.compile(rf"[+-]?(?:{_NUMBER_PATTERN}(?:{_UNIT_PATTERN}))+")
_DURATION_TERM_RE = re.compile(rf"({_NUMBER_PATTERN})({_UNIT_PATTERN})")
_BARE_NUMBER_RE = re.compile(rf"[+-]?{_NUMBER_PATTERN}")
_MAX_DURATION_NS = 2**63 - 1  # Go's time.Duration is an int64 count of nanoseconds


def parse_duration(text: str) -> datetime.timedelta:
    """Parse a Go duration string such as ``"168h"``, ``"1h30m"``, ``"500ms"`` or ``"-1h"``.

    A duration is an optional sign followed by one or more decimal numbers,
    each with an optional fraction and a unit suffix: ``ns``, ``us`` (or
    ``µs``), ``ms``, ``s``, ``m``, ``h``. The string ``"0"`` (optionally
    signed) is the only number accepted without a unit. The result is
    truncated to whole microseconds (``timedelta``'s resolution).

    Raises:
        ValueError: ``text`` is not valid duration syntax or is out of the
            range of a Go duration (about 292 years).
        TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"a duration must be a string such as \"168h\", got {text!r}")
    sign, body = 1, text
    if body[:1] in ("+", "-"):
        sign = -1 if body[0] == "-" else 1
        body = body[1:]
    if body == "0":
        return datetime.timedelta(0)
    if not _DURATION_RE.fullmatch(text):
        if _BARE_NUMBER_RE.fullmatch(text):
            raise ValueError(
                f"invalid duration {text!r}: missing unit (for example \"{body}s\"; "
                "units: ns, us, ms, s, m, h)"
            )
        raise ValueError(
            f"invalid duration {text!r}: expected Go duration syntax such as "
            "\"168h\", \"1h30m\" or \"500ms\" (units: ns, us, ms, s, m, h)"
        )
    total = Fraction(0)
    for number, unit in _DURATION_TERM_RE.findall(body):
        total += Fraction(number) * _NS_PER_UNIT[unit]
    nanoseconds = int(total)  # truncate like Go
    if nanoseconds > _MAX_DURATION_NS:
        raise ValueError(f"invalid duration {text!r}: out of range")
    return sign * datetime.timedelta(microseconds=nanoseconds // 1000)


def _format_fraction(value: int, precision: int) -> tuple[str, int]:
    """Split ``value`` into ``value // 10**precision`` and its fraction text (Go's fmtFrac)."""
    scale = 10**precision
    digits = f"{value % scale:0{precision}d}".rstrip("0")
    return ("." + digits if digits else ""), value // scale


def format_duration(td: datetime.timedelta) -> str:
    """Render ``td`` the way Go's ``time.Duration.String`` does (``"168h0m0s"``, ``"1.5s"``).

    :func:`parse_duration` reads the result back to the same value.
    """
    total_us = (td.days * 86_400 + td.seconds) * 1_000_000 + td.microseconds
    nanoseconds = abs(total_us) * 1000
    sign = "-" if total_us < 0 else ""
    if nanoseconds == 0:
        return "0s"
    if nanoseconds < 1_000_000_000:
        if nanoseconds < 1_000:
            unit, precision = "ns", 0
        elif nanoseconds < 1_000_000:
            unit, precision = "\u00b5s", 3
        else:
            unit, precision = "ms", 6
        fraction, whole = _format_fraction(nanoseconds, precision)
        return f"{sign}{whole}{fraction}{unit}"
    fraction, seconds = _format_fraction(nanoseconds, 9)
    text = f"{seconds % 60}{fraction}s"
    minutes = seconds // 60
    if minutes:
        text = f"{minutes % 60}m{text}"
        hours = minutes // 60
        if hours:
            text = f"{hours}h{text}"
    return sign + text


# ---------------------------------------------------------------------------
# The configuration dataclasses
# ---------------------------------------------------------------------------


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
class Config:
    """The whole configuration of one messenger instance (the YAML document).

    Build it with :meth:`from_dict` / :func:`load_config` (which validate), or in
    code followed by :meth:`validate`. ``Messenger`` calls :meth:`validate` on the
    configuration it receives as well.

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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Config:
        """Build a configuration from a parsed YAML document (nested mappings) and validate it.

        Absent keys and YAML ``null`` values take their defaults. A duration may be
        a Go duration string, the integer 0 or a ``datetime.timedelta``.

        Raises:
            ConfigError: listing every problem found (unknown keys, wrong types,
                invalid values).
        """
        problems = _Problems()
        if not isinstance(d, Mapping):
            raise ConfigError(
                [f"the configuration must be a mapping of keys to values, got {_describe(d)}"]
            )
        config = _build(cls, d, "", problems)
        _check_config(config, problems)
        if problems.messages:
            raise ConfigError(problems.messages)
        return config

    def to_dict(self) -> dict[str, Any]:
        """Return the configuration in the YAML shape (durations as Go duration strings).

        ``Config.from_dict(config.to_dict()) == config`` for a valid configuration.
        """
        result = _to_plain(self)
        assert isinstance(result, dict)
        return result

    def validate(self) -> None:
        """Check the configuration; raise :class:`ConfigError` listing every problem.

        Useful for a configuration built in code; :meth:`from_dict` and
        :func:`load_config` already call it, and so does ``Messenger``.
        """
        problems = _Problems()
        _check_config(self, problems)
        if problems.messages:
            raise ConfigError(problems.messages)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read a YAML configuration file and return the validated :class:`Config`.

    Raises:
        ConfigError: the file cannot be read, is empty, is not valid YAML, its top
            level is not a mapping, or the configuration is invalid (every problem
            is listed).
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as stream:
            text = stream.read()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError([f"{name}: cannot read configuration file: {reason}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{name}: configuration file is not UTF-8 text: {exc}"]) from exc
    import yaml  # only configuration files need it; importing it costs ~2 MB of RSS

    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{name}: malformed YAML: {_describe_yaml_error(exc)}"]) from exc
    if document is None:
        raise ConfigError([f"{name}: configuration file is empty"])
    if not isinstance(document, Mapping):
        kind = _describe(document)
        raise ConfigError(
            [f"{name}: the top level must be a mapping of keys to values, got {kind}"]
        )
    return Config.from_dict(document)


# ---------------------------------------------------------------------------
# Implementation: building from a mapping
# ---------------------------------------------------------------------------

_SECTIONS: dict[str, type] = {
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
_ITEM_LISTS: dict[str, type] = {
    "list[AllowedPeer]": AllowedPeer,
    "list[HubEndpoint]": HubEndpoint,
}
_UNKNOWN_KEY_HINTS: dict[str, str] = {
    "storage.max_segment_bytes": (
        "the segment size is set by storage.compaction_threshold_mb, in MiB"
    ),
}


class _Problems:
    """Collects problem messages and remembers keys whose values are unusable."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._bad: set[str] = set()

    def add(self, key: str, message: str, *, bad: bool = False) -> None:
        self.messages.append(f"{key}: {message}")
        if bad:
            self._bad.add(key)

    def usable(self, *keys: str) -> bool:
        """True if none of ``keys`` (nor a section or list containing it) was unusable."""
        return not any(self._is_bad(key) for key in keys)

    def _is_bad(self, key: str) -> bool:
        while key:
            if key in self._bad:
                return True
            cut = max(key.rfind("."), key.rfind("["))
            if cut <= 0:
                return False
            key = key[:cut]
        return False


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _describe(value: object) -> str:
    """``"string 'abc'"``, ``"boolean True"``, ``"list"``... for problem messages."""
    name = _type_name(value)
    if value is None or isinstance(value, (Mapping, list, tuple)) or is_dataclass(value):
        return name
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{name} {text}"


def _describe_yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _build(cls: type, raw: Mapping[Any, Any], path: str, problems: _Problems) -> Any:
    """Instantiate dataclass ``cls`` from mapping ``raw``; structural problems go to ``problems``.

    Scalars are passed through unchanged (type checks happen in ``_check_config``);
    sections and list items are built recursively, durations parsed, and unknown keys
    reported.
    """
    known = {f.name: f for f in fields(cls)}
    for key in raw:
        if key not in known:
            _report_unknown_key(path, key, list(known), problems)
    kwargs: dict[str, Any] = {}
    for name, spec in known.items():
        key = _join(path, name)
        if name not in raw or raw[name] is None:
            if spec.default is MISSING and spec.default_factory is MISSING:
                kwargs[name] = ""  # required field of a list item; reported as missing
            continue
        value = raw[name]
        kind = spec.type
        if kind in _SECTIONS:
            if isinstance(value, Mapping):
                kwargs[name] = _build(_SECTIONS[kind], value, key, problems)
            else:
                problems.add(key, f"must be a mapping, got {_describe(value)}", bad=True)
        elif kind in _ITEM_LISTS:
            kwargs[name] = _build_items(_ITEM_LISTS[kind], value, key, problems)
        elif kind == "datetime.timedelta":
            ttl = _to_duration(value, key, problems)
            if ttl is not None:
                kwargs[name] = ttl if ttl else spec.default  # zero means default
        elif kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            kwargs[name] = float(value)
        elif kind == "list[str]" and isinstance(value, (list, tuple)):
            kwargs[name] = list(value)
        elif cls is TLSConfig and name == "min_version" and isinstance(value, float) \
                and value in (1.2, 1.3):
            kwargs[name] = str(value)  # unquoted YAML number 1.2 / 1.3
        else:
            kwargs[name] = value
    return cls(**kwargs)


def _report_unknown_key(path: str, key: object, known: list[str], problems: _Problems) -> None:
    dotted = _join(path, str(key))
    hint = _UNKNOWN_KEY_HINTS.get(dotted)
    if hint is None and isinstance(key, str):
        close = difflib.get_close_matches(key, known, n=1)
        if close:
            hint = f"did you mean {_join(path, close[0])}?"
    problems.add(dotted, f"unknown key ({hint})" if hint else "unknown key")


def _build_items(cls: type, value: Any, key: str, problems: _Problems) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        problems.add(key, f"must be a list of mappings, got {_describe(value)}", bad=True)
        return []
    items: list[Any] = []
    for index, entry in enumerate(value):
        item_key = f"{key}[{index}]"
        if isinstance(entry, cls):
            items.append(entry)
        elif isinstance(entry, Mapping):
            items.append(_build(cls, entry, item_key, problems))
        else:
            problems.add(item_key, f"must be a mapping, got {_describe(entry)}", bad=True)
            items.append(_build(cls, {}, item_key, problems))  # placeholder keeps indices
    return items


def _to_duration(value: Any, key: str, problems: _Problems) -> datetime.timedelta | None:
    """Convert a YAML value to a duration, or report it and return None."""
    if isinstance(value, datetime.timedelta):
        return value
    if isinstance(value, bool):
        problems.add(key, f"must be a duration such as \"168h\", got {_describe(value)}",
                     bad=True)
        return None
    if isinstance(value, (int, float)):
        if value == 0:
            return datetime.timedelta(0)
        problems.add(
            key,
            f"a bare number is not a duration, add a unit (for example \"{value}s\"), "
            f"got {_describe(value)}",
            bad=True,
        )
        return None
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError as exc:
            problems.add(key, str(exc), bad=True)
            return None
    problems.add(key, f"must be a duration such as \"168h\", got {_describe(value)}", bad=True)
    return None


def _to_plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(item) for item in value]
    if isinstance(value, datetime.timedelta):
        return format_duration(value)
    return value


# ---------------------------------------------------------------------------
# Implementation: validation
# ---------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SCALAR_TYPES: dict[str, tuple[Any, str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_int(v) or isinstance(v, float), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "datetime.timedelta": (
        lambda v: isinstance(v, datetime.timedelta), "a duration such as \"168h\""
    ),
}


def _check_types(obj: Any, path: str, problems: _Problems) -> None:
    """Report (and mark unusable) every field of ``obj`` whose value has the wrong type."""
    for spec in fields(obj):
        key = _join(path, spec.name)
        value = getattr(obj, spec.name)
        kind = spec.type
        if kind in _SECTIONS:
            section = _SECTIONS[kind]
            if isinstance(value, section):
                _check_types(value, key, problems)
            else:
                problems.add(key, f"must be of type {section.__name__}, got {_describe(value)}",
                             bad=True)
        elif kind in _ITEM_LISTS:
            item_cls = _ITEM_LISTS[kind]
            if not isinstance(value, list):
                problems.add(key, f"must be a list, got {_describe(value)}", bad=True)
                continue
            for index, item in enumerate(value):
                item_key = f"{key}[{index}]"
                if isinstance(item, item_cls):
                    _check_types(item, item_key, problems)
                else:
                    problems.add(item_key, f"must be of type {item_cls.__name__}, "
                                 f"got {_describe(item)}", bad=True)
        elif kind == "list[str]":
            _check_string_list(value, key, problems)
        else:
            check, expected = _SCALAR_TYPES[kind]
            if not check(value):
                message = f"must be {expected}, got {_describe(value)}"
                if kind == "str" and isinstance(value, (bool, int, float)):
                    message += " (put it in quotes)"
                problems.add(key, message, bad=True)


def _check_string_list(value: Any, key: str, problems: _Problems) -> None:
    if not isinstance(value, list):
        problems.add(key, f"must be a list of strings, got {_describe(value)}", bad=True)
        return
    for index, item in enumerate(value):
        if not isinstance(item, str):
            problems.add(f"{key}[{index}]", f"must be a string, got {_describe(item)}",
                         bad=True)


_PORT_RE = re.compile(r"[0-9]{1,5}")


def _split_host_port(addr: str) -> tuple[str, int] | None:
    """Split ``host:port`` / ``[v6]:port``; None if it does not have that shape."""
    if addr.startswith("["):
        end = addr.find("]")
        if end < 0 or addr[end + 1:end + 2] != ":":
            return None
        host, port_text = addr[1:end], addr[end + 2:]
    else:
        host, sep, port_text = addr.rpartition(":")
        if not sep or ":" in host:
            return None
    if any(ch.isspace() for ch in host) or not _PORT_RE.fullmatch(port_text):
        return None
    port = int(port_text)
    if port > 65535:
        return None
    return host, port


def _at_least(problems: _Problems, section: Any, path: str, name: str, minimum: int) -> None:
    """Report ``path.name`` if its (usable) value is below ``minimum``."""
    key = _join(path, name)
    if problems.usable(key):
        value = getattr(section, name)
        if value < minimum:
            problems.add(key, f"must be >= {minimum}, got {value}")


def _positive(problems: _Problems, section: Any, path: str, name: str) -> None:
    """Report ``path.name`` if its (usable) value is not > 0."""
    key = _join(path, name)
    if problems.usable(key):
        value = getattr(section, name)
        if value <= 0:
            problems.add(key, f"must be > 0, got {value}")


def _check_config(config: Config, problems: _Problems) -> None:
    """Append every type and value problem of ``config`` to ``problems``."""
    _check_types(config, "", problems)

    if problems.usable("name") and config.name == "":
        problems.add("name", "must not be empty (it defaults to the host name)")

    storage = config.storage
    if problems.usable("storage.data_dir") and storage.data_dir == "":
        problems.add("storage.data_dir", "required")
    _at_least(problems, storage, "storage", "sync_interval_ms", 0)
    _at_least(problems, storage, "storage", "offset_flush_interval_ms", 0)

    _at_least(problems, config.subscribers, "subscribers", "max_retries", 0)

    _check_hub(config, problems)
    _check_client(config, problems)
    _check_tls(config, problems)

    fed = config.federation
    _positive(problems, fed, "federation", "reconnect_base_ms")
    if (
        problems.usable("federation.reconnect_base_ms", "federation.reconnect_max_ms")
        and fed.reconnect_base_ms > 0
        and fed.reconnect_max_ms < fed.reconnect_base_ms
    ):
        problems.add(
            "federation.reconnect_max_ms",
            f"must be >= federation.reconnect_base_ms ({fed.reconnect_base_ms}), "
            f"got {fed.reconnect_max_ms}",
        )
    if problems.usable("federation.reconnect_jitter") and not 0 <= fed.reconnect_jitter <= 1:
        problems.add(
            "federation.reconnect_jitter", f"must be between 0 and 1, got {fed.reconnect_jitter}"
        )
    _positive(problems, fed, "federation", "send_buffer_messages")
    _positive(problems, fed, "federation", "max_batch_bytes")

    _positive(problems, config.dedup, "dedup", "seen_id_lru_size")
    _positive(problems, config.audit, "audit", "max_size_mb")
    _positive(problems, config.audit, "audit", "max_files")

    if problems.usable("metrics.listen_addr"):
        addr = config.metrics.listen_addr
        if addr != "" and _split_host_port(addr) is None:
            problems.add(
                "metrics.listen_addr",
                f"must be host:port with a port between 0 and 65535, got {addr!r}",
            )


def _check_hub(config: Config, problems: _Problems) -> None:
    if not problems.usable("hub"):
        return
    hub = config.hub
    enabled = problems.usable("hub.enabled") and hub.enabled
    if problems.usable("hub.listen_addr"):
        if hub.listen_addr == "":
            if enabled:
                problems.add("hub.listen_addr", "required when hub.enabled is true")
        elif _split_host_port(hub.listen_addr) is None:
            problems.add(
                "hub.listen_addr",
                f"must be host:port with a port between 0 and 65535, got {hub.listen_addr!r}",
            )
    if problems.usable("hub.allowed_peers"):
        first_seen: dict[str, str] = {}
        for index, peer in enumerate(hub.allowed_peers):
            key = f"hub.allowed_peers[{index}].name"
            if not problems.usable(key):
                continue
            if peer.name == "":
                problems.add(key, "required")
            elif peer.name in first_seen:
                problems.add(
                    key, f"duplicate peer name {peer.name!r} (also {first_seen[peer.name]})"
                )
            else:
                first_seen[peer.name] = key
    if problems.usable("hub.fed_client_offset_ttl") and not hub.fed_client_offset_ttl:
        problems.add(
            "hub.fed_client_offset_ttl",
            "must not be zero (use a negative duration such as \"-1h\" to disable the sweep)",
        )


def _check_client(config: Config, problems: _Problems) -> None:
    if not problems.usable("client"):
        return
    client = config.client
    enabled = problems.usable("client.enabled") and client.enabled
    if not problems.usable("client.hubs"):
        return
    if enabled and not client.hubs:
        problems.add("client.hubs", "at least one hub is required when client.enabled is true")
    for index, hub in enumerate(client.hubs):
        key = f"client.hubs[{index}].addr"
        if not problems.usable(key):
            continue
        if hub.addr == "":
            if enabled:
                problems.add(key, "required when client.enabled is true")
            continue
        parts = _split_host_port(hub.addr)
        if parts is None or parts[0] == "" or parts[1] == 0:
            problems.add(
                key, f"must be host:port with a port between 1 and 65535, got {hub.addr!r}"
            )


def _check_tls(config: Config, problems: _Problems) -> None:
    if not problems.usable("tls"):
        return
    tls = config.tls
    roles = [
        f"{role}.enabled is true"
        for role in ("hub", "client")
        if problems.usable(f"{role}.enabled") and getattr(config, role).enabled
    ]
    cert_set = problems.usable("tls.cert") and tls.cert != ""
    key_set = problems.usable("tls.key") and tls.key != ""
    # Federation is always TLS: an enabled hub or client without the files is
    # refused here rather than dialing or listening in plaintext.
    reasons = {"cert": list(roles), "key": list(roles), "ca": list(roles)}
    if key_set:
        reasons["cert"].append("tls.key is set")
    if cert_set:
        reasons["key"].append("tls.cert is set")
        reasons["ca"].append("tls.cert is set")
    for name, why in reasons.items():
        key = f"tls.{name}"
        if why and problems.usable(key) and getattr(tls, name) == "":
            problems.add(key, f"required when {why[0]}")
    if problems.usable("tls.min_version") and tls.min_version not in ("1.2", "1.3"):
        problems.add("tls.min_version", f"must be \"1.2\" or \"1.3\", got {tls.min_version!r}")
    _at_least(problems, tls, "tls", "expiry_warn_days", 0)
