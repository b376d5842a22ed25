"""Exceptions raised by keyop-messenger.

Every error the library raises on purpose is a :class:`KeyopError`. The Rust
engine's errors are mapped onto these classes in one place (the binding's
``errors.rs``); the Python layer raises them directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "ChannelNotFoundError",
    "ClosedError",
    "ConfigError",
    "DataDirLockedError",
    "DataDirNotFoundError",
    "DataLossError",
    "FederationError",
    "ForkedProcessError",
    "InvalidNameError",
    "KeyopError",
    "KeyopTimeoutError",
    "MessageTooLargeError",
    "PayloadTypeError",
    "PolicyError",
    "StorageError",
    "SubscriptionError",
    "send_batch",
    "unicode_error",
]


class KeyopError(Exception):
    """Base class of every keyop-messenger error."""


class ConfigError(KeyopError, ValueError):
    """The configuration is invalid.

    ``problems`` lists every problem found, one message each; ``str(err)``
    shows them all. ``path`` is the configuration file they were found in
    (``None`` for a configuration given as a mapping); ``str(err)`` names it.
    """

    def __init__(self, problems: list[str] | str, path: str | None = None) -> None:
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = list(problems)
        self.path: str | None = path
        where = f" in {path}" if path is not None else ""
        if len(self.problems) == 1:
            text = f"invalid configuration{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            text = f"invalid configuration{where}:\n{lines}"
        super().__init__(text)


class InvalidNameError(KeyopError, ValueError):
    """A channel name, subscriber id or other name that becomes a path is not allowed."""


class PayloadTypeError(KeyopError, TypeError):
    """A payload does not match its registered type, or cannot be encoded as JSON."""


class MessageTooLargeError(KeyopError, ValueError):
    """An encoded message is larger than the 10 MiB record limit."""


class StorageError(KeyopError, OSError):
    """Reading or writing the data directory failed; a failed publish was not committed.

    The message names the file; ``errno`` is the OS error (e.g. ``errno.ENOSPC``,
    ``errno.EIO``, ``errno.EROFS``) when the OS reported one, else ``None``."""


class DataDirLockedError(StorageError):
    """The data directory is in use: another messenger (in this process or
    another) holds its lock file, ``keyop.lock``. Close that messenger, use a
    different ``storage.data_dir``, or publish through a hub with an
    :class:`~keyop_messenger.EphemeralMessenger`; read a held directory with
    :func:`~keyop_messenger.read_channel`."""


class DataDirNotFoundError(StorageError, FileNotFoundError):
    """The data directory does not exist. Only opening a :class:`~keyop_messenger.Messenger`
    creates one; readers (``read_channel``, the CLI, the Spark source) never do. Check
    the path, or open a Messenger on it first."""


class ChannelNotFoundError(StorageError, FileNotFoundError):
    """The channel does not exist in the data directory (no ``channels/<name>/``
    folder): check its spelling, or publish to it first."""


class DataLossError(KeyopError, RuntimeError):
    """Data a reader was positioned on is gone (deleted by retention, a removed or
    truncated segment): the message says which channel and which byte range.
    Nothing is skipped silently; pass the read path's ``skip_gaps``-style option
    to go on past the gap."""


class PolicyError(KeyopError, PermissionError):
    """A hub refused what was sent: the channel is not in this peer's allowlist,
    the record is over the hub's size limit, or it is not a valid record. The
    message names the channel and the hub. Nothing refused was acknowledged."""


class ForkedProcessError(KeyopError, RuntimeError):
    """The object was opened in another process (before ``os.fork()``). Its files,
    threads and connections belong to the parent: open a new one in the child."""


class KeyopTimeoutError(KeyopError, TimeoutError):
    """A bounded wait ran out (connect, publish, flush or close); the message
    says what was still pending. Catch it as the built-in ``TimeoutError``."""


class ClosedError(KeyopError, RuntimeError):
    """The messenger (or subscription) has been closed."""


class SubscriptionError(KeyopError, RuntimeError):
    """A subscriber id is already subscribed, or an unsubscribed id does not exist."""


class FederationError(KeyopError, RuntimeError):
    """Federation could not start: bad TLS material, a listen address in use, a bad hub address.

    A hub that is down is not an error: the client keeps dialing it in the background.
    """


class CertificateError(KeyopError, ValueError):
    """A certificate or key given to ``keyop-messenger keygen`` is unusable (not a
    CA, wrong key type, key does not match), or an argument is invalid."""


class ConnectionLostError(KeyopError, ConnectionError):
    """An ephemeral publish was not acknowledged by the hub: the connection was
    lost (or never made). The hub may or may not have stored the message."""


class BufferFullError(KeyopError):
    """The ephemeral client's bounded outbound buffer is full; the message was
    not queued. Retry later or raise ``federation.send_buffer_messages``."""


class MetricsError(KeyopError, OSError):
    """The metrics listener could not start (bad address, port in use)."""


#: Texts whose errors are :class:`InvalidNameError` (the engine's field
#: rules for them raise it too); anything else at fault is the payload.
_NAMES = ("channel", "subscriber_id", "payload_type", "service_name", "correlation_id")


def unicode_error(exc: UnicodeEncodeError, **texts: object) -> KeyopError:
    """The library error for text that cannot be handed to the engine (a lone
    surrogate): :class:`InvalidNameError` when ``texts`` names the channel,
    subscriber id, payload type, service name or correlation id at fault, as
    the engine's rules for those fields do; else :class:`PayloadTypeError`."""
    for what, value in texts.items():
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                cls = InvalidNameError if what in _NAMES else PayloadTypeError
                return cls(f"{what.replace('_', ' ')} {value!r} is not valid Unicode text")
    return PayloadTypeError(f"text is not valid Unicode: {exc}")


def send_batch(
    send: Callable[
        [str, list[tuple[str, Any]], str | None, str | None, Callable[[Any], Any]], list[str]
    ],
    channel: str,
    pairs: list[tuple[str, Any]],
    service_name: str | None,
    correlation_id: str | None,
    default: Callable[[Any], Any],
) -> list[str]:
    """``send(channel, pairs, service_name, correlation_id, default)``: hands
    a batch to the engine (a messenger's or an ephemeral client's
    ``publish_batch``); text it cannot take becomes :func:`unicode_error`'s
    error, naming the channel, service name, correlation id or payload type
    at fault."""
    try:
        return send(channel, pairs, service_name, correlation_id, default)
    except UnicodeEncodeError as exc:
        raise unicode_error(
            exc, channel=channel, service_name=service_name, correlation_id=correlation_id,
            **{f"payload_type {i}": p[0] for i, p in enumerate(pairs) if isinstance(p, tuple)},
        ) from None
