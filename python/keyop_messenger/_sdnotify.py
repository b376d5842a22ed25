"""systemd's notification protocol (``sd_notify``), without a systemd library.

With ``Type=notify`` systemd sets ``NOTIFY_SOCKET`` to the path of an AF_UNIX
datagram socket (a leading ``@`` means the Linux abstract namespace) and, with
``WatchdogSec=``, ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``). Each notification is
one datagram of ``KEY=VALUE`` lines: ``READY=1``, ``STOPPING=1``, ``WATCHDOG=1``,
``STATUS=...``. Without ``NOTIFY_SOCKET`` every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["Notifier"]

log = logging.getLogger("keyop_messenger.service")


class Notifier:
    """Sends notifications to the socket named by ``NOTIFY_SOCKET`` (if any)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr: str | bytes | None = None
        if addr.startswith("@"):
            self._addr = b"\0" + addr[1:].encode()
        elif addr.startswith("/"):
            self._addr = addr
        elif addr:
            log.warning("NOTIFY_SOCKET=%r is neither a path nor an @abstract name: ignored", addr)
        self.watchdog_s = _watchdog_seconds(env)

    @property
    def enabled(self) -> bool:
        """Whether ``NOTIFY_SOCKET`` names a socket."""
        return self._addr is not None

    def notify(self, *lines: str) -> bool:
        """Sends ``lines`` as one datagram; returns whether it was sent. A failure
        is logged (systemd then notices the missing READY or WATCHDOG by itself)."""
        if self._addr is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(lines).encode(), self._addr)
        except OSError as exc:
            log.warning("sd_notify %s: %s", " ".join(lines), exc)
            return False
        return True


def _watchdog_seconds(env: Mapping[str, str]) -> float | None:
    """The watchdog timeout in seconds, or None (unset, not for this process, bad value)."""
    usec = env.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer: watchdog pings off", usec)
        return None
    return value / 1e6 if value > 0 else None
