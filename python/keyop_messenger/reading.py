"""Reading a channel's records: ``read_channel`` over any data directory
(no lock taken), and the checks and entries ``Messenger.read_channel`` shares
with it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from . import _core
from .errors import ConfigError, unicode_error
from .message import LogEntry, entry_from_row
from .payloads import PayloadRegistry
from .positions import Position, to_core

__all__ = ["read_channel"]


def check_start_offset(start_offset: int) -> None:
    """A ``start_offset`` must be a byte offset (>= 0): :class:`ConfigError`
    otherwise. Whether it starts a record is checked by the engine."""
    kind, _ = to_core(start_offset, "start_offset")
    if kind != "offset":
        raise ConfigError(
            f"start_offset={start_offset!r} is not a byte offset; use since= for other positions"
        )


def read_channel(
    data_dir: str | os.PathLike[str],
    channel: str,
    *,
    start_offset: int = 0,
    registry: PayloadRegistry | None = None,
    skip_gaps: bool = False,
    since: Position | None = None,
    until: Position | None = None,
    limit: int | None = None,
) -> Iterator[LogEntry]:
    """Iterates the messages of ``channel`` in any data directory, also one
    written by keyop-messenger 1.4 or in use by another process. Only whole
    records are returned. Unreadable records are quarantined (copied to
    ``<data_dir>/quarantine/<channel>/<offset>.jsonl``, logged once) and
    passed over. Bytes gone after ``start_offset`` (0: the oldest record kept)
    raise :class:`DataLossError` naming the byte range, unless ``skip_gaps``.
    ``since``, ``until`` and ``limit`` are as in :meth:`Messenger.read_channel`
    (a time is found by bisection, not by reading the whole channel).

    Raises (at the call, not at the first ``next()``)
    :class:`DataDirNotFoundError` if ``data_dir`` does not exist and
    :class:`ChannelNotFoundError` if the channel does not; it never creates
    anything; :class:`ConfigError` for a ``start_offset`` that is negative,
    past the end of the channel or not the start of a record."""
    check_limit(limit)
    check_start_offset(start_offset)
    path = os.fspath(data_dir)
    try:
        if since is not None:
            start_offset = _core.resolve_position(path, channel, *to_core(since, "since"))
        end = None
        if until is not None:
            end = _core.resolve_position(path, channel, *to_core(until, "until"))
        rows = _core.read_channel(path, channel, start_offset, skip_gaps=skip_gaps, until=end)
    except UnicodeEncodeError as exc:
        raise unicode_error(exc, channel=channel) from None
    return entries(rows, registry, limit)


def check_limit(limit: int | None) -> None:
    """Refuses a negative ``limit``."""
    if limit is not None and limit < 0:
        raise ConfigError(f"limit={limit} is negative; pass a count of 0 or more, or None")


def entries(
    rows: Iterable[Any], registry: PayloadRegistry | None, limit: int | None
) -> Iterator[LogEntry]:
    """Log entries of engine rows, at most ``limit`` of them."""
    for n, row in enumerate(rows):
        if limit is not None and n >= limit:
            return
        yield entry_from_row(row, registry)
