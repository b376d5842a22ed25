"""The Messenger: durable local publish on top of the Rust engine."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

from . import _core
from .config import Config, load_config
from .context import current_context
from .message import LogEntry, entry_from_row
from .payloads import PayloadRegistry, to_plain

__all__ = ["Messenger", "read_channel"]

_MIB = 1024 * 1024


class Messenger:
    """A messenger instance owning one data directory.

    ``publish()`` returns once the message is committed: fdatasynced with
    ``storage.sync_interval_ms: 0`` (concurrent publishers share one fsync),
    or written to the file with ``sync_interval_ms > 0`` (a timer fsyncs).
    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, config: Config | str | os.PathLike[str]) -> None:
        if not isinstance(config, Config):
            config = load_config(config)
        config.validate()
        self._config = config
        self._registry = PayloadRegistry()
        self._lock = threading.Lock()
        self._closed = False
        storage = config.storage
        self._engine = _core.Engine(
            storage.data_dir,
            config.name,
            sync_interval_ms=storage.sync_interval_ms,
            segment_bytes=max(storage.compaction_threshold_mb, 0) * _MIB,
        )

    @property
    def config(self) -> Config:
        """The configuration this messenger was built from."""
        return self._config

    @property
    def name(self) -> str:
        """The instance name, written as ``origin`` in published envelopes."""
        return self._config.name

    def register_payload_type(self, name: str, cls: type) -> None:
        """Associates payload type ``name`` with ``cls`` (dataclass, pydantic
        model, ``dict`` or ``TypedDict``): publishes of that type are checked
        against it and delivered payloads are decoded into it."""
        self._registry.register(name, cls)

    def _meta(
        self, service_name: str | None, correlation_id: str | None
    ) -> tuple[str | None, str | None]:
        ctx_service, ctx_corr = current_context()
        return (
            service_name if service_name is not None else ctx_service,
            correlation_id if correlation_id is not None else ctx_corr,
        )

    def publish(
        self,
        channel: str,
        payload_type: str,
        payload: Any,
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
    ) -> str:
        """Publishes one message and returns its id once it is committed.

        Raises :class:`InvalidNameError` for a bad channel name,
        :class:`PayloadTypeError` if the payload does not match its registered
        type or is not JSON-encodable, :class:`MessageTooLargeError` over
        10 MiB, :class:`StorageError` if it was not committed, and
        :class:`ClosedError` after :meth:`close`.
        """
        self._registry.check(payload_type, payload)
        service, corr = self._meta(service_name, correlation_id)
        return self._engine.publish(channel, payload_type, payload, service, corr, to_plain)

    def publish_batch(
        self,
        channel: str,
        items: Iterable[tuple[str, Any]],
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
    ) -> list[str]:
        """Publishes ``(payload_type, payload)`` pairs with one write and one
        fsync: all are committed or none is. Returns their ids in order."""
        pairs = [tuple(item) for item in items]
        for pair in pairs:
            if len(pair) == 2:
                self._registry.check(pair[0], pair[1])
        service, corr = self._meta(service_name, correlation_id)
        return self._engine.publish_batch(channel, pairs, service, corr, to_plain)

    def read_channel(self, channel: str, *, start_offset: int = 0) -> Iterator[LogEntry]:
        """Iterates the committed messages of ``channel`` from ``start_offset``
        (a global byte offset), decoding payloads with the registered types."""
        for row in self._engine.read(channel, start_offset):
            yield entry_from_row(row, self._registry)

    def stream_end(self, channel: str) -> int:
        """The committed end of ``channel``: the offset the next record gets."""
        return self._engine.stream_end(channel)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Flushes and closes every channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._engine.close()

    def __enter__(self) -> Messenger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Messenger {self.name!r} data_dir={self._config.storage.data_dir!r} {state}>"


def read_channel(
    data_dir: str | os.PathLike[str],
    channel: str,
    *,
    start_offset: int = 0,
    registry: PayloadRegistry | None = None,
) -> Iterator[LogEntry]:
    """Iterates the messages of ``channel`` in any data directory, also one
    written by keyop-messenger 1.4 or in use by another process. Only whole
    records are returned; unreadable lines are skipped with a warning."""
    for row in _core.read_channel(os.fspath(data_dir), channel, start_offset):
        yield entry_from_row(row, registry)
