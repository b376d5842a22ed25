"""The message type handed to readers and subscribers."""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

from .payloads import PayloadRegistry

__all__ = ["LogEntry", "Message"]

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """One message as stored in a channel."""

    id: str
    """Message id (a UUIDv7 for messages published by keyop-messenger)."""
    channel: str
    """Channel the message was published to."""
    origin: str
    """Instance name of the original publisher."""
    payload_type: str
    """Type discriminator chosen by the publisher."""
    payload: Any
    """Payload, decoded into the registered type, else plain JSON data."""
    timestamp: datetime.datetime
    """Publish time, an aware UTC datetime (microsecond precision)."""
    service_name: str | None = None
    """Name of the publishing service, if set."""
    correlation_id: str | None = None
    """Correlation id, if set."""


@dataclasses.dataclass(frozen=True, slots=True)
class LogEntry:
    """A message and where it is stored in its channel."""

    offset: int
    """Global byte offset of the record in the channel's stream."""
    segment: int
    """Start offset of the segment file holding the record."""
    message: Message


def message_from_parts(
    id_: str,
    ts_nanos: int,
    channel: str,
    origin: str,
    payload_type: str,
    service_name: str | None,
    correlation_id: str | None,
    payload_json: str,
    registry: PayloadRegistry | None,
) -> Message:
    """Builds a :class:`Message` from the engine's envelope fields; the payload
    is decoded with ``registry`` (raises ``PayloadTypeError`` if it does not fit)."""
    data = json.loads(payload_json)
    payload = registry.decode(payload_type, data) if registry is not None else data
    timestamp = _EPOCH + datetime.timedelta(microseconds=ts_nanos // 1000)
    return Message(
        id_, channel, origin, payload_type, payload, timestamp, service_name, correlation_id
    )


def entry_from_row(row: tuple[Any, ...], registry: PayloadRegistry | None) -> LogEntry:
    """Builds a :class:`LogEntry` from a row of ``_core.RecordIter``."""
    offset, segment, *fields = row
    return LogEntry(offset, segment, message_from_parts(*fields, registry))
