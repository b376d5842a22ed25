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


def entry_from_row(row: tuple[Any, ...], registry: PayloadRegistry | None) -> LogEntry:
    """Builds a :class:`LogEntry` from a row of ``_core.RecordIter``."""
    (offset, segment, id_, ts_nanos, channel, origin, ptype, service, corr, payload_json) = row
    data = json.loads(payload_json)
    payload = registry.decode(ptype, data) if registry is not None else data
    timestamp = _EPOCH + datetime.timedelta(microseconds=ts_nanos // 1000)
    return LogEntry(
        offset,
        segment,
        Message(id_, channel, origin, ptype, payload, timestamp, service, corr),
    )
