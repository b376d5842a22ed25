"""Subscriptions: delivering a channel to a callback, at least once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

from . import _core
from .errors import PayloadTypeError
from .message import Message, message_from_parts
from .payloads import PayloadRegistry

__all__ = ["Handler", "Subscription"]

log = logging.getLogger("keyop_messenger")

Handler = Callable[[Message], Any]
"""A subscriber callback: returning acknowledges, raising means retry."""

_Failure = tuple[bool, str] | None


def make_deliver(
    handler: Handler, registry: PayloadRegistry, channel: str, subscriber_id: str
) -> Callable[[list[tuple[Any, ...]]], tuple[int, _Failure]]:
    """The batch function the engine calls (GIL held, engine thread): it
    decodes and hands each row to ``handler`` in order and reports how many
    were handled and why the next one failed."""

    def deliver(rows: list[tuple[Any, ...]]) -> tuple[int, _Failure]:
        for i, (_offset, *fields) in enumerate(rows):
            try:
                message = message_from_parts(*fields, registry)
            except (PayloadTypeError, ValueError) as exc:
                log.warning("%s/%s: undecodable message %s: %s", channel, subscriber_id,
                            fields[0], exc)
                return i, (True, str(exc))
            try:
                handler(message)
            except Exception as exc:
                log.warning("%s/%s: handler failed on %s: %r", channel, subscriber_id,
                            message.id, exc)
                log.debug("handler traceback", exc_info=True)
                return i, (False, f"{type(exc).__name__}: {exc}")
        return len(rows), None

    return deliver


class Subscription:
    """A running subscription. ``close()`` stops delivery and keeps the
    subscriber's offset, so subscribing again with the same id resumes."""

    def __init__(self, core: _core.Subscription) -> None:
        self._core = core

    @property
    def channel(self) -> str:
        """The channel delivered."""
        return self._core.channel

    @property
    def subscriber_id(self) -> str:
        """The subscriber id (names the offset file)."""
        return self._core.subscriber_id

    @property
    def position(self) -> int:
        """Global offset of the next message not yet acknowledged."""
        return self._core.position

    def close(self) -> None:
        """Stops delivery after the handler call in progress (if any) and
        persists the offset. Idempotent; may be called from the handler."""
        self._core.close()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Subscription {self.channel!r}/{self.subscriber_id!r} at {self.position}>"
