"""Type stubs of the compiled engine module (kept in step with rust/python/src/lib.rs)."""

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from os import PathLike
from typing import Any, final

from typing_extensions import disjoint_base

__all__ = [
    "MAX_RECORD_BYTES",
    "Engine",
    "EphemeralClient",
    "MessengerBase",
    "RecordIter",
    "Subscription",
    "__version__",
    "inspect_cert",
    "keygen_ca",
    "keygen_instance",
    "read_channel",
    "validate_channel",
]

__version__: str
MAX_RECORD_BYTES: int

_Row = tuple[int, int, str, int, str, str, str, str | None, str | None, Any]
_DeliveryRow = tuple[int, str, int, str, str, str, str | None, str | None, Any]

@disjoint_base
class MessengerBase:
    def __new__(cls, *_args: Any, **_kwargs: Any) -> MessengerBase: ...
    def _bind_publish(
        self,
        engine: Engine,
        registry: Mapping[str, object],
        check: Callable[[str, Any], None],
        context: ContextVar[tuple[str | None, str | None]],
        default: Callable[[Any], Any],
        unicode_error: Callable[..., Exception],
    ) -> None: ...
    def publish(
        self,
        channel: str,
        payload_type: str,
        payload: Any,
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
    ) -> str: ...

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
        items: Iterable[tuple[str, Any]],
        service_name: str | None = None,
        correlation_id: str | None = None,
        default: Callable[[Any], Any] | None = None,
        ids: list[str] | None = None,
    ) -> list[str]: ...
    def stream_end(self, channel: str) -> int: ...
    def read(self, channel: str, start_offset: int = 0) -> RecordIter: ...
    def subscribe(
        self,
        channel: str,
        subscriber_id: str,
        deliver: Callable[[list[_DeliveryRow]], tuple[int, tuple[bool, str] | None]],
        *,
        max_retries: int = 5,
        offset_flush_interval_ms: int = 0,
        backoff_base_ms: int = 100,
        backoff_max_ms: int = 5000,
    ) -> Subscription: ...
    def unsubscribe(self, channel: str, subscriber_id: str) -> None: ...
    def start_retention(
        self, interval_ms: int, max_lag_bytes: int | None = None, offset_ttl_ms: int | None = None
    ) -> None: ...
    def compact(
        self, max_lag_bytes: int | None = None, offset_ttl_ms: int | None = None
    ) -> dict[str, tuple[int, int, list[str]]]: ...
    def start_federation(self, settings_json: str) -> None: ...
    @property
    def hub_address(self) -> tuple[str, int] | None: ...
    def federation_status(self) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
    def _counters(self, channel: str) -> dict[str, int]: ...
    def _inject_fault(self, channel: str, kind: str, count: int = 1, partial: int = 0) -> None: ...
    def _simulate_power_loss(self, torn: int = 0) -> None: ...
    def close(self) -> None: ...

@final
class RecordIter:
    def __iter__(self) -> RecordIter: ...
    def __next__(self) -> _Row: ...
    @property
    def position(self) -> int: ...

@final
class Subscription:
    @property
    def channel(self) -> str: ...
    @property
    def subscriber_id(self) -> str: ...
    @property
    def position(self) -> int: ...
    def close(self) -> None: ...

@final
class EphemeralClient:
    def __new__(cls, settings_json: str) -> EphemeralClient: ...
    def connect(self, timeout_s: float) -> None: ...
    def set_handler(self, deliver: Callable[[list[_DeliveryRow]], object]) -> None: ...
    def publish_batch(
        self,
        channel: str,
        items: Iterable[tuple[str, Any]],
        service_name: str | None = None,
        correlation_id: str | None = None,
        default: Callable[[Any], Any] | None = None,
        ids: list[str] | None = None,
    ) -> list[str]: ...
    def status(self) -> dict[str, Any]: ...
    def close(self) -> None: ...

def validate_channel(name: str) -> None: ...
def read_channel(
    data_dir: str | PathLike[str], channel: str, start_offset: int = 0
) -> RecordIter: ...
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
