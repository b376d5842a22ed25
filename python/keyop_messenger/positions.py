"""Start positions of subscriptions and reads: where in a channel to begin."""

from __future__ import annotations

import datetime
from typing import Literal

from .errors import ConfigError

__all__ = ["Position"]

Position = Literal["earliest", "latest"] | int | datetime.datetime
Position.__doc__ = """Where to start in a channel: ``"earliest"`` (the oldest record kept),
``"latest"`` (the current end: only records published later), an ``int``
global byte offset that starts a record (a ``LogEntry.offset``, a
``Subscription.position`` or ``stream_end()``), or a timezone-aware
``datetime`` (the first record whose publish time is at or after it)."""

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def to_core(position: Position, what: str = "start") -> tuple[str, int]:
    """The engine's form of ``position``: ``(kind, value)``. Raises
    :class:`ConfigError` (a ``ValueError``) for anything else, and for a
    datetime without a timezone."""
    if position == "earliest" or position == "latest":
        return str(position), 0
    if isinstance(position, datetime.datetime):
        if position.tzinfo is None or position.utcoffset() is None:
            raise ConfigError(
                f"{what}={position!r} is a naive datetime: it has no timezone, so it could "
                "mean any instant; pass an aware one, e.g. "
                "datetime.now(timezone.utc) or dt.replace(tzinfo=timezone.utc)"
            )
        delta = position - _EPOCH
        ns = delta // datetime.timedelta(microseconds=1) * 1000
        # The engine counts nanoseconds in 64 bits (years 1677-2262): a time
        # beyond is before (after) every record, as the bound is.
        return "time", min(max(ns, -(2**63)), 2**63 - 1)
    if isinstance(position, int) and not isinstance(position, bool):
        if position < 0:
            raise ConfigError(f"{what}={position} is negative; byte offsets start at 0")
        if position >= 2**63:
            raise ConfigError(
                f"{what}={position} is beyond any byte offset a channel reaches (2**63 - 1)"
            )
        return "offset", position
    raise ConfigError(
        f"{what}={position!r} is not a position; use 'earliest', 'latest', an int byte "
        "offset of a record, or a timezone-aware datetime"
    )
