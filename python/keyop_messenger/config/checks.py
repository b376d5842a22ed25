"""Checks of a valid configuration against the machine (``keyop-messenger run --check``):
the TLS files are readable and their certificates within their validity dates,
the data directory is (or can be made) a writable folder, and the listen
addresses resolve. :func:`check_environment` returns the problems, each starting
with the dotted key it is about, as :class:`~keyop_messenger.errors.ConfigError` does;
:func:`check_warnings` what is not a problem yet (a certificate expiring soon).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .loading import Config

__all__ = ["certificate_validity", "check_environment", "check_warnings"]


def certificate_validity(path: str) -> list[tuple[str, datetime.datetime, datetime.datetime]]:
    """``(subject, valid_from, valid_until)`` of every certificate in the PEM/DER file."""
    from .. import _core

    out = []
    for block in _core.inspect_cert(path).split("\n\n"):
        fields = {}
        for line in block.splitlines():
            label, _, value = line.partition(":")
            fields[label.strip()] = value.strip()
        out.append(
            (
                fields.get("Subject", "?"),
                _parse_ts(fields["Valid from"]),
                _parse_ts(fields["Valid until"]),
            )
        )
    return out


def _parse_ts(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _iso(dt: datetime.datetime) -> str:
    return dt.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_readable(key: str, path: str, problems: list[str]) -> bool:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        problems.append(f"{key}: cannot read {path}: {exc.strerror or exc}")
        return False
    return True


def _check_certificates(key: str, path: str, now: datetime.datetime, problems: list[str]) -> None:
    try:
        certs = certificate_validity(path)
    except Exception as exc:
        problems.append(f"{key}: {path}: {' '.join(str(exc).split())}")
        return
    for subject, start, end in certs:
        window = f"valid from {_iso(start)} until {_iso(end)}"
        if now > end:
            problems.append(
                f"{key}: {path}: certificate {subject!r} expired on {_iso(end)} ({window}, "
                f"now {_iso(now)}); make a new one with keyop-messenger keygen"
            )
        elif now < start:
            problems.append(
                f"{key}: {path}: certificate {subject!r} is not valid before {_iso(start)} "
                f"({window}, now {_iso(now)}); check the clock"
            )


def _check_data_dir(data_dir: str, problems: list[str]) -> None:
    key = "storage.data_dir"
    if os.path.exists(data_dir):
        if not os.path.isdir(data_dir):
            problems.append(f"{key}: {data_dir} exists and is not a directory")
        elif not _can_create_in(data_dir):
            problems.append(f"{key}: {data_dir} is not writable by this user")
        return
    parent = os.path.dirname(os.path.abspath(data_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not _can_create_in(parent):
        problems.append(
            f"{key}: {data_dir} does not exist and cannot be created ({parent} is not a "
            "writable directory)"
        )


def _can_create_in(directory: str) -> bool:
    """Whether a directory can be made in ``directory``: tried (a temporary
    one, removed at once), as permission bits do not tell for root, read-only
    mounts or file systems such as /proc."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".keyop-check-", dir=directory))
    except OSError:
        return False
    return True


def _check_addr(key: str, addr: str, problems: list[str]) -> None:
    from .validation import _split_host_port

    parts = _split_host_port(addr)
    if parts is None:
        return  # reported by validation
    host, port = parts
    try:
        socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        problems.append(f"{key}: cannot resolve {host!r} of {addr!r}: {exc}")


def _check_tls_material(config: Config, problems: list[str]) -> None:
    """The checks federation and the gateway make when they load the files:
    the key's permissions, the key belongs to the certificate, the chain."""
    from .. import _core
    from ..errors import FederationError

    tls = config.tls
    try:
        _core.check_tls(tls.cert, tls.key, tls.ca, tls.min_version)
    except FederationError as exc:
        problems.append(str(exc))  # it names the tls.* key


def check_environment(config: Config, now: datetime.datetime | None = None) -> list[str]:
    """Every problem of ``config`` on this machine (empty if none)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    problems: list[str] = []
    tls = config.tls
    readable = 0
    for name in ("cert", "key", "ca"):
        path = getattr(tls, name)
        if path and _check_readable(f"tls.{name}", path, problems):
            readable += 1
            if name != "key":
                _check_certificates(f"tls.{name}", path, now, problems)
    if readable == 3 and not problems:
        _check_tls_material(config, problems)
    _check_data_dir(config.storage.data_dir, problems)
    if config.hub.enabled and config.hub.listen_addr:
        _check_addr("hub.listen_addr", config.hub.listen_addr, problems)
    if config.metrics.listen_addr:
        _check_addr("metrics.listen_addr", config.metrics.listen_addr, problems)
    return problems


def check_warnings(config: Config, now: datetime.datetime | None = None) -> list[str]:
    """What ``run`` would warn of at startup: the instance certificate
    (``tls.cert``) or the first CA certificate (``tls.ca``) expiring within
    ``tls.expiry_warn_days``. Unreadable files are :func:`check_environment`'s
    problems, not warnings."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    days = config.tls.expiry_warn_days
    warnings: list[str] = []
    for name in ("cert", "ca"):
        path = getattr(config.tls, name)
        if not path:
            continue
        try:
            subject, start, end = certificate_validity(path)[0]
        except Exception:
            continue
        if start <= now <= end and end - now < datetime.timedelta(days=days):
            warnings.append(
                f"tls.{name}: {path}: certificate {subject!r} expires on {_iso(end)}, within "
                f"tls.expiry_warn_days ({days}); make a new one with keyop-messenger keygen"
            )
    return warnings
