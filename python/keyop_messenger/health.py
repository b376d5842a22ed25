"""Health of a serving messenger: what ``/healthz``, ``/readyz`` and ``/status``
on the metrics listener answer (``docs/service.md``).

* ``/healthz``: 200 while the process serves HTTP at all (liveness).
* ``/readyz``: 200 once the messenger is ready (storage open, listeners bound);
  503 while starting, while stopping, or when storage is failing (the data
  directory is gone or ``stats()`` fails).
* ``/status``: a JSON document built from ``Messenger.stats()`` and
  ``Messenger.federation_status()`` (the figures ``keyop-messenger stats``
  prints) with the version, uptime, the last logged warning or error and the
  refused connection counts; per channel also the newest record's time and
  rates (messages/s, bytes/s) over the last :data:`RATE_WINDOW_S` seconds of
  ``/status`` requests, per subscriber its lag in seconds. The status page
  (``/`` on the metrics listener) polls it.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Any, Protocol

__all__ = ["RATE_WINDOW_S", "Health", "HealthSource"]

STARTING, READY, STOPPING = "starting", "ready", "stopping"

RATE_WINDOW_S = 10.0
"""Seconds of counter samples (one per ``/status`` request) a channel's rates span."""


class HealthSource(Protocol):
    """What :class:`Health` reads: a :class:`~keyop_messenger.Messenger` fits."""

    def stats(self) -> Any:
        """A :class:`~keyop_messenger.stats.Stats` snapshot."""
        ...


def _iso(value: datetime.datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


class _LastProblem(logging.Handler):
    """Keeps the last record at WARNING or above logged under ``keyop_messenger``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: dict[str, Any] | None = None
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not break logging
            message = str(record.msg)
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        self.last = {
            "ts": _iso(ts),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        self.count += 1


_PROBLEMS: _LastProblem | None = None
_PROBLEMS_LOCK = threading.Lock()


def _problems() -> _LastProblem:
    """The one handler on the ``keyop_messenger`` logger recording problems."""
    global _PROBLEMS
    with _PROBLEMS_LOCK:
        if _PROBLEMS is None:
            _PROBLEMS = _LastProblem()
            logging.getLogger("keyop_messenger").addHandler(_PROBLEMS)
        return _PROBLEMS


class _Rates:
    """Per-channel rates from the counters of successive ``/status`` requests:
    the change since the oldest sample kept (at most :data:`RATE_WINDOW_S`
    seconds old, or else the newest one) divided by the time between.
    Thread-safe."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._lock = threading.Lock()

    def update(
        self, now: float, counts: dict[str, tuple[int, int]]
    ) -> dict[str, tuple[float | None, float | None]]:
        """Records ``{channel: (messages, bytes)}`` at ``now`` (monotonic seconds);
        returns ``{channel: (messages/s, bytes/s)}``, ``(None, None)`` for a
        channel without an earlier sample (or with counters that went back)."""
        with self._lock:
            recent = [s for s in self._samples if now - s[0] <= RATE_WINDOW_S]
            self._samples = recent or self._samples[-1:]
            base = self._samples[0] if self._samples else None
            if not self._samples or now - self._samples[-1][0] >= 0.2:
                self._samples.append((now, counts))
        rates: dict[str, tuple[float | None, float | None]] = {}
        for name, (messages, size) in counts.items():
            before = None if base is None else base[1].get(name)
            elapsed = 0.0 if base is None else now - base[0]
            if before is None or elapsed <= 0 or messages < before[0] or size < before[1]:
                rates[name] = (None, None)
            else:
                rates[name] = (
                    round((messages - before[0]) / elapsed, 3),
                    round((size - before[1]) / elapsed, 3),
                )
        return rates


class Health:
    """The state (``starting`` -> ``ready`` -> ``stopping``) of one serving
    messenger, its readiness and its status document. Thread-safe.

    ``source`` is the messenger (None until it is open); ``ready=True`` starts
    in the ready state (a messenger serving its own metrics listener is open
    before the listener starts).
    """

    def __init__(self, source: HealthSource | None = None, *, ready: bool = False) -> None:
        self.source = source
        self._state = READY if ready and source is not None else STARTING
        self._started = time.monotonic()
        self._started_at = datetime.datetime.now(datetime.timezone.utc)
        self._problems = _problems()
        self._rates = _Rates()

    @property
    def state(self) -> str:
        """``starting``, ``ready`` or ``stopping``."""
        return self._state

    def mark_ready(self, source: HealthSource | None = None) -> None:
        """The messenger is open and its listeners are bound."""
        if source is not None:
            self.source = source
        if self._state == STARTING:
            self._state = READY

    def mark_stopping(self) -> None:
        """Shutdown began: ``/readyz`` answers 503 from now on."""
        self._state = STOPPING

    def readiness(self) -> tuple[bool, str]:
        """``(ready, reason)``: ready only in the ready state with working storage."""
        source = self.source
        if self._state != READY or source is None:
            return False, self._state
        data_dir = _data_dir(source)
        if data_dir is not None and not os.path.isdir(data_dir):
            return False, f"storage failing: data directory {data_dir} is missing"
        try:
            source.stats()
        except Exception as exc:
            return False, f"storage failing: {' '.join(str(exc).split()) or type(exc).__name__}"
        return True, READY

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (see the module docstring)."""
        from ._core import __version__

        ready, reason = self.readiness()
        doc: dict[str, Any] = {
            "version": __version__,
            "now": _iso(datetime.datetime.now(datetime.timezone.utc)),
            "name": getattr(getattr(self.source, "config", None), "name", None),
            "state": self._state,
            "ready": ready,
            "reason": reason,
            "started_at": _iso(self._started_at),
            "uptime_s": round(time.monotonic() - self._started, 3),
            "rate_window_s": RATE_WINDOW_S,
            "channels": [],
            "peers": [],
            "links": [],
            "refused": {
                "connections_rejected": 0,
                "connections_failed": 0,
                "records_refused_from_peers": 0,
                "client_failed_attempts": 0,
                "records_refused_by_hubs": 0,
            },
            "last_error": self._problems.last,
            "warnings_logged": self._problems.count,
        }
        source = self.source
        if source is None or not ready:
            return doc
        _fill(doc, source, self._rates)
        return doc


def _data_dir(source: HealthSource) -> str | None:
    config = getattr(source, "config", None)
    data_dir = getattr(getattr(config, "storage", None), "data_dir", None)
    return data_dir if isinstance(data_dir, str) and data_dir else None


def _lag_s(oldest_pending: datetime.datetime | None, now: datetime.datetime) -> float | None:
    if oldest_pending is None:
        return None
    return round(max(0.0, (now - oldest_pending).total_seconds()), 3)


def _fill(doc: dict[str, Any], source: HealthSource, rates: _Rates) -> None:
    stats = source.stats()
    now = datetime.datetime.now(datetime.timezone.utc)
    per_channel = rates.update(
        time.monotonic(),
        {c.name: (c.messages_published, c.stream_bytes) for c in stats.channels},
    )
    doc["channels"] = [
        {
            "name": c.name,
            "end_offset": c.stream_bytes,
            "disk_bytes": c.disk_bytes,
            "messages_published": c.messages_published,
            "last_message_at": _iso(getattr(c, "last_message", None)),
            "messages_per_s": per_channel[c.name][0],
            "bytes_per_s": per_channel[c.name][1],
            "subscribers": [
                {
                    "id": s.id,
                    "lag_bytes": s.lag_bytes,
                    "lag_s": _lag_s(s.oldest_pending, now),
                    "oldest_pending": _iso(s.oldest_pending),
                    "active": s.active,
                }
                for s in c.subscribers
            ],
        }
        for c in stats.channels
    ]
    listener = stats.federation.listener
    if listener is not None:
        doc["hub"] = {
            "listen_addr": listener.listen_addr,
            "records_received": listener.records_received,
            "connections_accepted": listener.connections_accepted,
            "connections_rejected": listener.connections_rejected,
            "connections_failed": dict(listener.connections_failed),
            "records_refused": dict(listener.records_refused),
        }
        doc["peers"] = [{"name": p, "state": "connected"} for p in listener.peers]
        refused = doc["refused"]
        refused["connections_rejected"] = listener.connections_rejected
        refused["connections_failed"] = sum(listener.connections_failed.values())
        refused["records_refused_from_peers"] = sum(listener.records_refused.values())
    fed_status = getattr(source, "federation_status", None)
    clients = fed_status().clients if callable(fed_status) else []
    failed = {c.addr: c.failed_attempts for c in clients}
    refused_subs = {c.addr: list(c.refused_subscriptions) for c in clients}
    doc["links"] = [
        {
            "addr": link.addr,
            "state": "connected" if link.connected else "disconnected",
            "reconnects": link.reconnects,
            "failed_attempts": failed.get(link.addr, 0),
            "unacked_bytes": link.unacked_bytes,
            "refused": dict(getattr(link, "refused", {})),
            "refused_channels": list(getattr(link, "refused_channels", [])),
            "refused_subscriptions": refused_subs.get(link.addr, []),
        }
        for link in stats.federation.links
    ]
    doc["refused"]["client_failed_attempts"] = sum(failed.values())
    doc["refused"]["records_refused_by_hubs"] = sum(
        sum(link["refused"].values()) for link in doc["links"]
    )
