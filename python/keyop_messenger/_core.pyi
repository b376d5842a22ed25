"""Type stubs of the compiled engine module (kept in step with rust/python/src/lib.rs)."""

import asyncio
import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from os import PathLike
from typing import Any, ClassVar, Literal, final, overload

from typing_extensions import Self, disjoint_base

__all__ = [
    "MAX_RECORD_BYTES",
    "ColumnIter",
    "Completer",
    "Engine",
    "EphemeralClient",
    "FramedBatch",
    "Message",
    "MessengerBase",
    "PayloadBatch",
    "Receipt",
    "RecordIter",
    "Subscription",
    "__version__",
    "check_timeout",
    "check_tls",
    "encode_columns",
    "encode_records",
    "inspect_cert",
    "keygen_ca",
    "keygen_instance",
    "loss_counts",
    "parse_payload_fields",
    "read_channel",
    "read_columns",
    "read_stats",
    "reset_log_cache",
    "resolve_position",
    "validate_channel",
    "validate_field",
    "validate_payload_type",
    "validate_peer_name",
]

__version__: str
MAX_RECORD_BYTES: int

_Row = tuple[int, int, str, int, str, str, str, str | None, str | None, Any]
_DeliveryRow = tuple[int, str, int, str, str, str, str | None, str | None, Any]
_Text = tuple[bytes, bytes, bytes | None, int]
_ColumnRows = tuple[int, bytes, bytes, bytes, _Text, _Text, _Text, _Text, _Text, _Text, _Text]
# A column buffer: bytes, or an immutable pyarrow.Buffer (read in place).
_Buffer = bytes | Any
_ColumnSpec = tuple[str, str, int, _Buffer | None, _Buffer, _Buffer | None]

@final
class Message:
    """One message as stored in a channel (read-only).

    Attributes:
        id: Message id (a UUIDv7 for messages published by keyop-messenger).
        channel: Channel the message was published to.
        origin: Instance name of the original publisher.
        payload_type: Type discriminator chosen by the publisher.
        payload: The payload, decoded into the registered type, else plain JSON data.
            A delivered message keeps its payload as JSON text until this is first
            read, so a handler that never reads it never pays for decoding it.
        timestamp: Publish time, an aware UTC datetime (microsecond precision).
        service_name: Name of the publishing service, if set.
        correlation_id: Correlation id, if set.
    """

    __hash__: ClassVar[None]  # type: ignore[assignment]
    def __new__(
        cls,
        id: str,
        channel: str,
        origin: str,
        payload_type: str,
        payload: Any,
        timestamp: datetime.datetime | int,
        service_name: str | None = None,
        correlation_id: str | None = None,
    ) -> Self: ...
    @property
    def id(self) -> str: ...
    @property
    def channel(self) -> str: ...
    @property
    def origin(self) -> str: ...
    @property
    def payload_type(self) -> str: ...
    @property
    def payload(self) -> Any: ...
    @property
    def timestamp(self) -> datetime.datetime: ...
    @property
    def service_name(self) -> str | None: ...
    @property
    def correlation_id(self) -> str | None: ...
    @property
    def _ts(self) -> int | datetime.datetime: ...
    def _with_payload(self, payload: Any) -> Message: ...
    def _unreadable(self) -> str | None: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __reduce__(self) -> tuple[type[Message], tuple[Any, ...]]: ...

@disjoint_base
class MessengerBase:
    def __new__(cls, *_args: Any, **_kwargs: Any) -> Self: ...
    def _bind_publish(
        self,
        engine: Engine,
        registry: Mapping[str, object],
        check: Callable[[str, Any], None],
        context: ContextVar[tuple[str | None, str | None]],
        default: Callable[[Any], Any],
        unicode_error: Callable[..., Exception],
    ) -> None: ...
    @overload
    def publish(
        self,
        channel: str,
        payload_type: str,
        payload: Any,
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
        wait: Literal[True] = True,
    ) -> str:
        """Publishes one message and returns its id once it is committed.

        Committed means fdatasynced with ``storage.sync_interval_ms: 0`` (concurrent
        publishers on a channel share one write and one fdatasync), or written to the file
        with ``sync_interval_ms > 0`` (a timer fdatasyncs). The GIL is released while it waits.

        Args:
            channel: the channel to append to (a valid name, not a ``.dead-letter`` channel).
            payload_type: the payload's type name; a registered name checks ``payload``
                against its class, any other name accepts any JSON value.
            payload: the message body.
            service_name: overrides the ``service_name`` of :func:`keyop_messenger.context`.
            correlation_id: overrides the ``correlation_id`` of :func:`keyop_messenger.context`.
            wait: ``False`` returns a :class:`Receipt` as soon as the message is handed to
                the channel's committer (pipelining: many messages share each fdatasync);
                its ``wait()`` gives the id once committed or raises what ``publish`` would.

        Returns:
            The message id (a UUIDv7), once committed; a :class:`Receipt` with ``wait=False``.

        Raises:
            InvalidNameError: the channel name is not allowed.
            PayloadTypeError: the payload does not match its registered type.
            MessageTooLargeError: the encoded message is over 10 MiB.
            StorageError: the message was not committed.
            ClosedError: the messenger is closed.
        """
        ...
    @overload
    def publish(
        self,
        channel: str,
        payload_type: str,
        payload: Any,
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
        wait: Literal[False],
    ) -> Receipt: ...
    @overload
    def publish(
        self,
        channel: str,
        payload_type: str,
        payload: Any,
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
        wait: bool,
    ) -> str | Receipt: ...

@final
class Receipt:
    """A message handed to the engine by ``publish(..., wait=False)``."""

    @property
    def id(self) -> str:
        """The message id (a UUIDv7), known before the commit."""
        ...
    def done(self) -> bool:
        """Whether the outcome (committed or failed) is known."""
        ...
    def wait(self, timeout: float | None = None) -> str:
        """Waits until the message is committed and returns its id.

        Raises what a blocking ``publish`` would have raised, or ``KeyopTimeoutError`` once
        ``timeout`` seconds pass (the message may still be committed later).
        """
        ...

@final
class Completer:
    def __new__(cls, event_loop: Any) -> Completer: ...
    def publish(
        self,
        messenger: MessengerBase,
        channel: str,
        payload_type: str,
        payload: Any,
        service_name: str | None = None,
        correlation_id: str | None = None,
    ) -> asyncio.Future[str]: ...
    def _release(self) -> None: ...
    def _drain(self) -> None: ...
    def close(self) -> None: ...

@final
class Engine:
    def __new__(
        cls,
        data_dir: str | PathLike[str],
        name: str,
        *,
        sync_interval_ms: int = 0,
        segment_bytes: int = 0,
    ) -> Engine: ...
    @property
    def name(self) -> str: ...
    def publish_batch(
        self,
        channel: str,
        items: Iterable[tuple[str, Any]] | PayloadBatch,
        service_name: str | None = None,
        correlation_id: str | None = None,
        default: Callable[[Any], Any] | None = None,
        ids: list[str] | None = None,
    ) -> list[str]: ...
    @overload
    def publish_framed(self, batch: FramedBatch, wait: Literal[True] = True) -> None: ...
    @overload
    def publish_framed(self, batch: FramedBatch, wait: Literal[False]) -> Receipt | None: ...
    def stream_end(self, channel: str) -> int: ...
    def resolve_position(self, channel: str, kind: str, value: int) -> int: ...
    def read(
        self,
        channel: str,
        start_offset: int = 0,
        *,
        skip_gaps: bool = False,
        until: int | None = None,
    ) -> RecordIter: ...
    def subscribe(
        self,
        channel: str,
        subscriber_id: str,
        deliver: Callable[
            [list[Message]], tuple[int, tuple[bool, str] | tuple[bool, str, bool] | None]
        ],
        *,
        max_retries: int = 5,
        offset_flush_interval_ms: int = 0,
        backoff_base_ms: int = 100,
        backoff_max_ms: int = 5000,
        on_gap: Callable[[int, int], object] | None = None,
        start_kind: str = "latest",
        start_value: int = 0,
        reset: bool = False,
        dead_letter: bool = True,
    ) -> Subscription: ...
    def unsubscribe(self, channel: str, subscriber_id: str) -> None: ...
    def start_retention(
        self,
        interval_ms: int,
        max_lag_bytes: int | None = None,
        offset_ttl_ms: int | None = None,
        max_age_ms: int | None = None,
        max_bytes: int | None = None,
        channels: Mapping[str, tuple[int | None, int | None]] | None = None,
    ) -> None: ...
    def compact(
        self,
        max_lag_bytes: int | None = None,
        offset_ttl_ms: int | None = None,
        max_age_ms: int | None = None,
        max_bytes: int | None = None,
        channels: Mapping[str, tuple[int | None, int | None]] | None = None,
    ) -> dict[str, tuple[int, int, list[str]]]: ...
    def start_federation(
        self, settings_json: str, events: Callable[[str, str, str, int], object] | None = None
    ) -> None: ...
    def create_client_cursors(self, hubs_json: str) -> None: ...
    def start_gateway(self, settings_json: str) -> None: ...
    def set_gateway_access(self, peers_json: str, tokens_json: str) -> None: ...
    @property
    def gateway_address(self) -> tuple[str, int] | None: ...
    def set_allowed_peers(self, peers_json: str) -> list[str]: ...
    def reload_tls(self, tls_json: str) -> None: ...
    @property
    def hub_address(self) -> tuple[str, int] | None: ...
    def federation_status(self) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
    def _counters(self, channel: str) -> dict[str, int]: ...
    def _inject_fault(
        self,
        channel: str,
        kind: str,
        count: int = 1,
        partial: int = 0,
        errno: int = 0,
        delay_ms: int = 0,
    ) -> None: ...
    def _replay_dead_letter(self, channel: str, offset: int) -> str: ...
    def _simulate_power_loss(self, torn: int = 0) -> None: ...
    def flush(self, timeout_s: float | None = None) -> None: ...
    def close(self, timeout_s: float | None = None) -> bool: ...
    def stop_waiting(self) -> None: ...
    @property
    def forked(self) -> bool: ...

@final
class RecordIter:
    def __iter__(self) -> RecordIter: ...
    def __next__(self) -> _Row: ...
    @property
    def position(self) -> int: ...

@final
class PayloadBatch:
    def __len__(self) -> int: ...
    def payloads(self) -> list[str]: ...

@final
class FramedBatch:
    """Records framed by :func:`encode_records`; ``publish_framed`` moves
    them out, so a batch is published once (again: RuntimeError)."""

    def __len__(self) -> int: ...
    @property
    def channel(self) -> str: ...
    @property
    def first_id(self) -> str | None: ...
    @property
    def last_id(self) -> str | None: ...

@final
class ColumnIter:
    def __iter__(self) -> ColumnIter: ...
    def __next__(self) -> _ColumnRows: ...

@final
class Subscription:
    @property
    def channel(self) -> str: ...
    @property
    def subscriber_id(self) -> str: ...
    @property
    def position(self) -> int: ...
    def seek(self, kind: str, value: int) -> None: ...
    def close(self, timeout_s: float | None = None) -> bool: ...

@final
class EphemeralClient:
    def __new__(
        cls, settings_json: str, events: Callable[[str, str, str, int], object] | None = None
    ) -> EphemeralClient: ...
    def connect(self, timeout_s: float) -> None: ...
    def set_handler(self, deliver: Callable[[list[_DeliveryRow]], object]) -> None: ...
    def publish_batch(
        self,
        channel: str,
        items: Iterable[tuple[str, Any]] | PayloadBatch,
        service_name: str | None = None,
        correlation_id: str | None = None,
        default: Callable[[Any], Any] | None = None,
        timeout_s: float | None = None,
        ids: list[str] | None = None,
    ) -> list[str]: ...
    def status(self) -> dict[str, Any]: ...
    def flush(self, timeout_s: float | None = None) -> None: ...
    def close(self) -> None: ...

def validate_channel(name: str) -> None: ...
def validate_peer_name(name: str) -> None: ...
def validate_payload_type(name: str) -> None: ...
def validate_field(field: str, value: str) -> None: ...
def check_timeout(timeout_s: float | None) -> None: ...
def check_tls(cert: str, key: str, ca: str, min_version: str = "1.3") -> None: ...
def read_channel(
    data_dir: str | PathLike[str],
    channel: str,
    start_offset: int = 0,
    *,
    skip_gaps: bool = False,
    until: int | None = None,
    check_start: bool = True,
) -> RecordIter: ...
def read_columns(
    data_dir: str | PathLike[str],
    channel: str,
    start_offset: int,
    until: int,
    *,
    skip_gaps: bool = False,
    batch_rows: int = 8192,
) -> ColumnIter: ...
def parse_payload_fields(
    data: bytes, rows: int, fields: Sequence[tuple[str, str]]
) -> list[tuple[bytes, bytes | None, bytes | None, int]] | None: ...
def encode_columns(
    payload_type: str,
    columns: Sequence[_ColumnSpec],
    rows: int,
    *,
    id_prefix: str | None = None,
    first_row: int = 0,
) -> PayloadBatch: ...
def encode_records(
    payload_type: str,
    columns: Sequence[_ColumnSpec],
    rows: int,
    *,
    origin: str,
    channel: str,
    id_prefix: str,
    first_row: int = 0,
    service_name: str | None = None,
    correlation_id: str | None = None,
) -> FramedBatch: ...
def resolve_position(data_dir: str | PathLike[str], channel: str, kind: str, value: int) -> int: ...
def read_stats(data_dir: str | PathLike[str]) -> dict[str, Any]: ...
def reset_log_cache() -> None: ...
def loss_counts() -> dict[str, int]: ...
def keygen_ca(
    out_cert: str | PathLike[str] = ...,
    out_key: str | PathLike[str] = ...,
    days: int = ...,
    force: bool = False,
) -> str: ...
def keygen_instance(
    ca: str | PathLike[str],
    ca_key: str | PathLike[str],
    name: str,
    out_cert: str | PathLike[str] | None = None,
    out_key: str | PathLike[str] | None = None,
    days: int = ...,
    force: bool = False,
    sans: Sequence[str] = ...,
) -> str: ...
def inspect_cert(path: str | PathLike[str]) -> str: ...
