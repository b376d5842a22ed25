"""Payload type registry: which Python type a ``payload_type`` string means.

Publishing turns a payload into plain JSON data; delivery turns the JSON back
into the registered type, deeply: nested dataclasses and pydantic models,
enums, ``datetime``/``date``/``time``, ``UUID``, ``Decimal``, ``Optional``/
``Union``, ``list[T]``, ``tuple``, ``set[T]`` and ``dict[str, T]`` come back as
they were published. Supported registered types are dataclasses, pydantic
models (when pydantic is installed) and ``dict``/``TypedDict`` classes; a
registered ``dict`` (or subclass) is delivered untouched. Payloads of
unregistered types are published as given (any JSON value) and delivered as
plain JSON data.

The JSON form of each Python type (``datetime`` as RFC 3339 strings,
``Decimal`` and ``UUID`` as strings, enums by value, ...) is the table in
:mod:`keyop_messenger._typed`. The decoder of a class is built once, when it
is registered; a field type JSON cannot carry is refused then, and a payload
that does not fit raises :class:`PayloadTypeError` naming the field path
(``location.lat: expected float, got str``).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, is_typeddict

from . import _core
from .errors import PayloadTypeError

__all__ = ["PayloadRegistry", "to_plain"]


def _is_pydantic_model(cls: type) -> bool:
    return callable(getattr(cls, "model_validate", None)) and callable(
        getattr(cls, "model_dump", None)
    )


def to_plain(value: Any) -> Any:
    """Turns one non-JSON value into JSON-ready data, one level deep.

    Used by the engine's JSON encoder for any value that is not ``None``,
    ``bool``, ``int``, ``float``, ``str``, ``dict``, ``list`` or ``tuple``;
    the encoder recurses into the result. A dataclass becomes an object of
    its fields, a pydantic model ``model_dump(mode="json")``, an enum its
    value, ``datetime``/``date``/``time`` ``isoformat()`` (RFC 3339 for an
    aware datetime), ``UUID`` and ``Decimal`` ``str()``, a set a sorted list.
    Anything else raises :class:`PayloadTypeError` before anything is written.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if _is_pydantic_model(type(value)):
        return value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if _is_uuid_or_decimal(value):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    raise PayloadTypeError(f"{type(value).__name__} values cannot be encoded as JSON")


def _is_uuid_or_decimal(value: object) -> bool:
    # A UUID or a Decimal can only exist once its module is imported: looking the
    # module up instead of importing it keeps uuid (with platform) and decimal out of
    # a process that never uses them (idle memory, docs/performance.md).
    for module, name in (("uuid", "UUID"), ("decimal", "Decimal")):
        found = sys.modules.get(module)
        if found is not None and isinstance(value, getattr(found, name)):
            return True
    return False


class _Entry:
    __slots__ = ("check", "cls", "decode")

    def __init__(
        self, cls: type, check: Callable[[Any], bool], decode: Callable[[Any], Any]
    ) -> None:
        self.cls = cls
        self.check = check
        self.decode = decode


class PayloadRegistry:
    """Maps payload type names to Python types; one per messenger."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        #: Registered names (read-only view; lets publish skip the check cheaply).
        self.entries: Mapping[str, object] = self._entries
        self._lock = threading.Lock()

    def register(self, name: str, cls: type) -> None:
        """Registers ``cls`` for payload type ``name``.

        Raises :class:`PayloadTypeError` if ``name`` is empty (a publish may
        use the empty ``payload_type``, as 1.4 allows, but it names no type)
        or already registered, or if ``cls`` is not a dataclass, a pydantic
        model, or a ``dict``/``TypedDict`` class; :class:`InvalidNameError` if
        ``name`` is not a valid ``payload_type`` (the engine's rule: at most
        255 bytes, no control characters), as a publish with it would be
        refused.
        """
        if not isinstance(name, str) or not name:
            raise PayloadTypeError("payload type name must be a non-empty string")
        _core.validate_payload_type(name)
        if not isinstance(cls, type):
            raise PayloadTypeError(f"payload type {name!r}: expected a class, got {cls!r}")
        entry = self._entry_for(name, cls)
        with self._lock:
            if name in self._entries:
                raise PayloadTypeError(f"payload type {name!r} is already registered")
            self._entries[name] = entry

    @staticmethod
    def _entry_for(name: str, cls: type) -> _Entry:
        if dataclasses.is_dataclass(cls) or _is_pydantic_model(cls):
            return _Entry(cls, lambda p: isinstance(p, cls), _decoder(name, cls))
        if is_typeddict(cls):
            return _Entry(cls, lambda p: isinstance(p, Mapping), _decoder(name, cls))
        if isinstance(cls, type) and issubclass(cls, dict):
            return _Entry(cls, lambda p: isinstance(p, Mapping), _require_mapping)
        raise PayloadTypeError(
            f"payload type {name!r}: {cls.__name__} is not a dataclass, pydantic model, "
            "dict or TypedDict"
        )

    def registered(self, name: str) -> type | None:
        """The class registered for ``name``, if any."""
        entry = self._entries.get(name)
        return entry.cls if entry else None

    def check(self, name: str, payload: Any, encoded: bytes | None = None) -> None:
        """Raises :class:`PayloadTypeError` if ``payload`` does not match the
        type registered for ``name``: not an instance of it, or fields that
        would not decode into it (checked on the payload's JSON form, as a
        subscriber will decode it, so nothing is stored that its readers
        would dead-letter). Unregistered names accept any payload.

        ``encoded``: the payload's JSON as the engine encoded it, when the
        caller has it (``publish`` does); otherwise it is encoded here."""
        entry = self._entries.get(name)
        if entry is None:
            return
        if not entry.check(payload):
            raise PayloadTypeError(
                f"payload for type {name!r} must be {entry.cls.__name__}, "
                f"got {type(payload).__name__}"
            )
        if entry.decode is _require_mapping:
            return  # a registered dict is delivered as it is
        try:
            if encoded is None:
                encoded = json.dumps(payload, default=to_plain, allow_nan=False).encode()
            data = json.loads(encoded)
        except (ValueError, TypeError, RecursionError):
            return  # not JSON at all: the engine refuses it with its own reason
        try:
            entry.decode(data)
        except Exception as exc:  # any constructor/validation failure
            raise PayloadTypeError(
                f"payload for type {name!r} does not fit {entry.cls.__name__}: {exc}"
            ) from None

    def check_batch(self, items: list[Any]) -> None:
        """:meth:`check` for each ``(payload_type, payload)`` pair of a batch;
        items of another shape are left for the engine to report."""
        if self.entries:
            for item in items:
                if isinstance(item, tuple) and len(item) == 2:
                    self.check(item[0], item[1])

    def decode(self, name: str, data: Any) -> Any:
        """Turns decoded JSON ``data`` into the type registered for ``name``
        (plain data when unregistered). Raises :class:`PayloadTypeError` when
        the data does not fit the registered type."""
        entry = self._entries.get(name)
        if entry is None:
            return data
        try:
            return entry.decode(data)
        except Exception as exc:  # any constructor/validation failure
            raise PayloadTypeError(
                f"payload of type {name!r} does not decode into {entry.cls.__name__}: {exc}"
            ) from exc


def _require_mapping(data: Any) -> Any:
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    return data


def _decoder(name: str, cls: type) -> Callable[[Any], Any]:
    """The deep decoder of ``cls``, built now; a field type JSON cannot carry
    is a :class:`PayloadTypeError` naming the field."""
    # Imported on the first registration: _typed needs uuid and decimal.
    from ._typed import UnsupportedType, build_decoder

    try:
        return build_decoder(cls)
    except UnsupportedType as exc:
        raise PayloadTypeError(f"payload type {name!r}: {exc}") from None
