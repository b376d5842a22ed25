"""Connection callbacks of Messenger and EphemeralMessenger.

The engine queues link events and one engine thread calls
``dispatch(kind, hub, detail, count)`` with the GIL; this module turns that
into the user's ``on_connect(hub)``, ``on_disconnect(hub, reason)`` and
``on_refused(hub, channel, count)``. An exception in a callback is logged and
swallowed: it never stops the link or later callbacks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["OnConnect", "OnDisconnect", "OnRefused", "dispatcher"]

log = logging.getLogger("keyop_messenger")

OnConnect = Callable[[str], Any]
"""``on_connect(hub)``: the link to ``hub`` (``host:port``) is up (also after a reconnect)."""
OnDisconnect = Callable[[str, str], Any]
"""``on_disconnect(hub, reason)``: the link to ``hub`` was lost; it is dialed again."""
OnRefused = Callable[[str, str, int], Any]
"""``on_refused(hub, channel, count)``: ``hub`` refused ``count`` records of
``channel`` (not stored there; a durable client keeps them in its files)."""


def dispatcher(
    on_connect: OnConnect | None,
    on_disconnect: OnDisconnect | None,
    on_refused: OnRefused | None,
) -> Callable[[str, str, str, int], None] | None:
    """The engine's event callable, or None when no callback is set."""
    if on_connect is None and on_disconnect is None and on_refused is None:
        return None

    def dispatch(kind: str, hub: str, detail: str, count: int) -> None:
        try:
            if kind == "connect" and on_connect is not None:
                on_connect(hub)
            elif kind == "disconnect" and on_disconnect is not None:
                on_disconnect(hub, detail)
            elif kind == "refused" and on_refused is not None:
                on_refused(hub, detail, count)
        except Exception:
            log.exception("the on_%s callback raised (hub %s); ignored", kind, hub)

    return dispatch
