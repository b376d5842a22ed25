"""Validation of a configuration: types of every field, then values and their combinations.

Every problem is collected (see :class:`.problems.Problems`); a value of the wrong
type is marked unusable so that checks depending on it are skipped rather than
reported twice.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import fields
from typing import Any

from .problems import Problems, describe, join_key
from .schema import ITEM_LISTS, SECTIONS, ConfigFields

#: Values of ``log.level`` ("" is the default, info).
LOG_LEVELS = ("", "debug", "info", "warning", "error")


#: Largest integer a configuration value may hold (2**53 - 1: exact in every
#: JSON reader, and within what the engine's counters and limits take).
MAX_INT = 2**53 - 1

#: Largest value of keys the engine holds in 32 bits.
MAX_U32 = 2**32 - 1

#: Largest segment size (MiB): 1 TiB.
MAX_SEGMENT_MB = 2**20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SCALAR_TYPES: dict[str, tuple[Any, str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an integer"),
    "int | None": (lambda v: v is None or _is_int(v), "an integer"),
    "float": (lambda v: _is_int(v) or isinstance(v, float), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "datetime.timedelta": (
        lambda v: isinstance(v, datetime.timedelta), "a duration such as \"168h\""
    ),
}


def _check_types(obj: Any, path: str, problems: Problems) -> None:
    """Report (and mark unusable) every field of ``obj`` whose value has the wrong type."""
    for spec in fields(obj):
        key = join_key(path, spec.name)
        value = getattr(obj, spec.name)
        kind = spec.type
        if kind in SECTIONS:
            section = SECTIONS[kind]
            if isinstance(value, section):
                _check_types(value, key, problems)
            else:
                problems.add(key, f"must be of type {section.__name__}, got {describe(value)}",
                             bad=True)
        elif kind in ITEM_LISTS:
            item_cls = ITEM_LISTS[kind]
            if not isinstance(value, list):
                problems.add(key, f"must be a list, got {describe(value)}", bad=True)
                continue
            for index, item in enumerate(value):
                item_key = f"{key}[{index}]"
                if isinstance(item, item_cls):
                    _check_types(item, item_key, problems)
                else:
                    problems.add(item_key, f"must be of type {item_cls.__name__}, "
                                 f"got {describe(item)}", bad=True)
        elif kind == "list[str]":
            _check_string_list(value, key, problems)
        else:
            check, expected = _SCALAR_TYPES[kind]
            if not check(value):
                message = f"must be {expected}, got {describe(value)}"
                if kind == "str" and isinstance(value, (bool, int, float)):
                    message += " (put it in quotes)"
                problems.add(key, message, bad=True)
            elif _is_int(value) and not -MAX_INT <= value <= MAX_INT:
                problems.add(key, f"must be between {-MAX_INT} and {MAX_INT}, got {value}",
                             bad=True)


def _check_string_list(value: Any, key: str, problems: Problems) -> None:
    if not isinstance(value, list):
        problems.add(key, f"must be a list of strings, got {describe(value)}", bad=True)
        return
    for index, item in enumerate(value):
        if not isinstance(item, str):
            problems.add(f"{key}[{index}]", f"must be a string, got {describe(item)}",
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


def _at_least(problems: Problems, section: Any, path: str, name: str, minimum: int) -> None:
    """Report ``path.name`` if its (usable) value is below ``minimum``."""
    key = join_key(path, name)
    if problems.usable(key):
        value = getattr(section, name)
        if value < minimum:
            problems.add(key, f"must be >= {minimum}, got {value}")


def _at_most(problems: Problems, section: Any, path: str, name: str, maximum: int) -> None:
    """Report ``path.name`` if its (usable) value is above ``maximum``."""
    key = join_key(path, name)
    if problems.usable(key):
        value = getattr(section, name)
        if value is not None and value > maximum:
            problems.add(key, f"must be <= {maximum}, got {value}")


def _positive(problems: Problems, section: Any, path: str, name: str) -> None:
    """Report ``path.name`` if its (usable) value is not > 0."""
    key = join_key(path, name)
    if problems.usable(key):
        value = getattr(section, name)
        if value <= 0:
            problems.add(key, f"must be > 0, got {value}")


def check_config(config: ConfigFields, problems: Problems) -> None:
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
    _at_most(problems, config.subscribers, "subscribers", "max_retries", MAX_U32)
    _check_segment_size(config, problems)
    _check_retention(config, problems)

    _check_hub(config, problems)
    _check_client(config, problems)
    _check_tls(config, problems)
    _check_gateway(config, problems)

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
    _at_most(problems, config.audit, "audit", "max_files", MAX_U32)

    if problems.usable("log.level") and config.log.level not in LOG_LEVELS:
        problems.add(
            "log.level",
            f'must be "debug", "info", "warning" or "error", got {config.log.level!r}',
        )

    if problems.usable("metrics.listen_addr"):
        addr = config.metrics.listen_addr
        if addr != "" and _split_host_port(addr) is None:
            problems.add(
                "metrics.listen_addr",
                f"must be host:port with a port between 0 and 65535, got {addr!r}",
            )


def _check_listen_addr(problems: Problems, section: str, addr: str, enabled: bool) -> None:
    """``<section>.listen_addr``: host:port, required when the section is enabled."""
    key = f"{section}.listen_addr"
    if not problems.usable(key):
        return
    if addr == "":
        if enabled:
            problems.add(key, f"required when {section}.enabled is true")
    elif _split_host_port(addr) is None:
        problems.add(key, f"must be host:port with a port between 0 and 65535, got {addr!r}")


def _check_hub(config: ConfigFields, problems: Problems) -> None:
    if not problems.usable("hub"):
        return
    hub = config.hub
    enabled = problems.usable("hub.enabled") and hub.enabled
    _check_listen_addr(problems, "hub", hub.listen_addr, enabled)
    if problems.usable("hub.allowed_peers"):
        first_seen: dict[str, str] = {}
        for index, peer in enumerate(hub.allowed_peers):
            key = f"hub.allowed_peers[{index}].name"
            if not problems.usable(key):
                continue
            if peer.name == "":
                problems.add(key, "required")
            elif (invalid := _invalid_peer_name(peer.name)) is not None:
                problems.add(key, invalid)
            elif peer.name in first_seen:
                problems.add(
                    key, f"duplicate peer name {peer.name!r} (also {first_seen[peer.name]})"
                )
            else:
                first_seen[peer.name] = key
            limit_key = f"hub.allowed_peers[{index}].max_channels"
            if problems.usable(limit_key) and peer.max_channels < 0:
                problems.add(limit_key, f"must be 0 or more, got {peer.max_channels}")
    if problems.usable("hub.fed_client_offset_ttl") and not hub.fed_client_offset_ttl:
        problems.add(
            "hub.fed_client_offset_ttl",
            "must not be zero (use a negative duration such as \"-1h\" to disable the sweep)",
        )


def _invalid_peer_name(name: str) -> str | None:
    """Why ``name`` cannot be a peer's certificate CN here, or None. The hub
    names the peer's cursor files after it, so it is held to the engine's rule
    for such names; a name the hub would refuse at connect time is refused
    when the configuration is loaded instead."""
    from .. import _core  # the engine's peer-name rule

    try:
        _core.validate_peer_name(name)
    except ValueError as exc:
        return str(exc)
    return None


def _check_client(config: ConfigFields, problems: Problems) -> None:
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


def _check_tls(config: ConfigFields, problems: Problems) -> None:
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


_TOKEN_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")


def _check_gateway(config: ConfigFields, problems: Problems) -> None:
    """Listener, TLS files, tokens (named, unique, hashes only) and limits."""
    if not problems.usable("gateway"):
        return
    gw = config.gateway
    enabled = problems.usable("gateway.enabled") and gw.enabled
    _check_listen_addr(problems, "gateway", gw.listen_addr, enabled)
    if enabled and problems.usable("tls"):
        for name in ("cert", "key", "ca"):
            key = f"tls.{name}"
            if problems.usable(key) and getattr(config.tls, name) == "":
                problems.add(key, "required when gateway.enabled is true (HTTPS only)")
    for name in ("max_body_bytes", "rate_limit_burst", "max_streams", "max_connections"):
        _positive(problems, gw, "gateway", name)
    _at_most(problems, gw, "gateway", "rate_limit_burst", MAX_U32)
    _at_least(problems, gw, "gateway", "rate_limit_per_s", 0)
    for name in ("header_timeout", "idle_timeout", "max_wait"):
        key = f"gateway.{name}"
        if problems.usable(key) and getattr(gw, name) <= datetime.timedelta(0):
            problems.add(key, f"must be > 0, got {getattr(gw, name)}")
    if not problems.usable("gateway.tokens"):
        return
    seen: dict[str, str] = {}
    hashes: dict[str, str] = {}
    for index, token in enumerate(gw.tokens):
        path = f"gateway.tokens[{index}]"
        if problems.usable(f"{path}.name"):
            if token.name == "":
                problems.add(f"{path}.name", "required")
            elif token.name in seen:
                problems.add(
                    f"{path}.name", f"duplicate token name {token.name!r} (also {seen[token.name]})"
                )
            else:
                seen[token.name] = f"{path}.name"
        if problems.usable(f"{path}.hash") and not _TOKEN_HASH_RE.fullmatch(token.hash):
            problems.add(
                f"{path}.hash",
                "must be sha256:<64 lowercase hex digits> (the hash printed by "
                "`keyop-messenger token create NAME`; never the token itself)",
            )
        elif problems.usable(f"{path}.hash"):
            if token.hash in hashes:
                # One token would match both entries: which access it gets is
                # not something to leave to list order.
                problems.add(
                    f"{path}.hash",
                    f"duplicate token hash: entry {token.name!r} has the same hash as "
                    f"{hashes[token.hash]}; create a token per entry",
                )
            else:
                hashes[token.hash] = f"{path} ({token.name!r})"
        for field in ("publish", "subscribe"):
            _check_channel_names(problems, f"{path}.{field}", getattr(token, field))


def _check_channel_names(problems: Problems, key: str, names: list[str]) -> None:
    """Reports the entries of the (usable) list ``key`` that are not channel names."""
    from .. import _core  # the engine's channel-name rule

    if not problems.usable(key):
        return
    for index, name in enumerate(names):
        try:
            _core.validate_channel(name)
        except ValueError as exc:  # InvalidNameError, or text that is not Unicode
            problems.add(f"{key}[{index}]", str(exc))


def _check_segment_size(config: ConfigFields, problems: Problems) -> None:
    storage = config.storage
    keys = ("storage.segment_size_mb", "storage.compaction_threshold_mb")
    if (
        problems.usable(*keys)
        and storage.segment_size_mb is not None
        and storage.compaction_threshold_mb is not None
    ):
        problems.add(
            "storage.compaction_threshold_mb",
            "set together with storage.segment_size_mb; compaction_threshold_mb is the "
            "deprecated name of segment_size_mb: keep only segment_size_mb",
        )
    # Segments of over 1 TiB would overflow the engine's byte counts once in bytes.
    for name in ("segment_size_mb", "compaction_threshold_mb"):
        _at_most(problems, storage, "storage", name, MAX_SEGMENT_MB)


def _check_retention(config: ConfigFields, problems: Problems) -> None:
    """Limits must not be negative; per-channel entries need a unique, valid name."""
    from .. import _core  # the engine's channel-name rule

    def limits(section: Any, path: str) -> None:
        _at_least(problems, section, path, "max_bytes", 0)
        key = join_key(path, "max_age")
        if problems.usable(key) and section.max_age < datetime.timedelta(0):
            problems.add(key, "must not be negative (0 switches it off)")

    limits(config.retention, "retention")
    if not problems.usable("retention.channels"):
        return
    seen: set[str] = set()
    for index, entry in enumerate(config.retention.channels):
        path = f"retention.channels[{index}]"
        limits(entry, path)
        key = f"{path}.name"
        if not problems.usable(key):
            continue
        if entry.name == "":
            problems.add(key, "required")
            continue
        try:
            _core.validate_channel(entry.name)
        except ValueError as exc:
            problems.add(key, str(exc))
            continue
        if entry.name in seen:
            problems.add(key, f"channel {entry.name!r} is listed twice")
        seen.add(entry.name)
