"""The message type handed to readers and subscribers."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from .payloads import PayloadRegistry

__all__ = ["LogEntry", "Message"]

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


class Message:
    """One message as stored in a channel (treat it as read-only).

    Attributes:
        id: Message id (a UUIDv7 for messages published by keyop-messenger).
        channel: Channel the message was published to.
        origin: Instance name of the original publisher.
        payload_type: Type discriminator chosen by the publisher.
        payload: The payload, decoded into the registered type, else plain JSON data.
        timestamp: Publish time, an aware UTC datetime (microsecond precision).
        service_name: Name of the publishing service, if set.
        correlation_id: Correlation id, if set.
    """

    __slots__ = (
        "_ts",
        "channel",
        "correlation_id",
        "id",
        "origin",
        "payload",
        "payload_type",
        "service_name",
    )

    def __init__(
        self,
        id: str,
        channel: str,
        origin: str,
        payload_type: str,
        payload: Any,
        timestamp: datetime.datetime | int,
        service_name: str | None = None,
        correlation_id: str | None = None,
    ) -> None:
        self.id = id
        self.channel = channel
        self.origin = origin
        self.payload_type = payload_type
        self.payload = payload
        # Nanoseconds since the epoch until first read (most handlers never ask).
        self._ts = timestamp
        self.service_name = service_name
        self.correlation_id = correlation_id

    @property
    def timestamp(self) -> datetime.datetime:
        """Publish time, an aware UTC datetime (microsecond precision)."""
        ts = self._ts
        if isinstance(ts, int):
            ts = self._ts = _EPOCH + datetime.timedelta(microseconds=ts // 1000)
        return ts

    def _key(self) -> tuple[Any, ...]:
        return (
            self.id,
            self.channel,
            self.origin,
            self.payload_type,
            self.payload,
            self.timestamp,
            self.service_name,
            self.correlation_id,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Message(id={self.id!r}, channel={self.channel!r}, origin={self.origin!r}, "
            f"payload_type={self.payload_type!r}, payload={self.payload!r}, "
            f"timestamp={self.timestamp!r}, service_name={self.service_name!r}, "
            f"correlation_id={self.correlation_id!r})"
        )


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
    data: Any,
    registry: PayloadRegistry | None,
) -> Message:
    """Builds a :class:`Message` from the engine's envelope fields; the payload
    is decoded with ``registry`` (raises ``PayloadTypeError`` if it does not fit)."""
    payload = registry.decode(payload_type, data) if registry is not None else data
    return Message(
        id_, channel, origin, payload_type, payload, ts_nanos, service_name, correlation_id
    )


def entry_from_row(row: tuple[Any, ...], registry: PayloadRegistry | None) -> LogEntry:
    """Builds a :class:`LogEntry` from a row of ``_core.RecordIter``."""
    offset, segment, *fields = row
    return LogEntry(offset, segment, message_from_parts(*fields, registry))
