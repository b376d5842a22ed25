"""The message type handed to readers and subscribers."""

from __future__ import annotations

import dataclasses
from typing import Any

# The engine's class: it builds one per delivered record (a Python class
# cost more than the rest of delivery); documented in _core.pyi.
from ._core import Message
from .payloads import PayloadRegistry

__all__ = ["LogEntry", "Message"]


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
