"""Deep decoding of JSON payloads into registered types (see :mod:`.payloads`).

A decoder is built once per registered class, when it is registered, by
walking its type hints: every field type is resolved to a small function that
checks and converts one JSON value. Delivering a message then costs one call
per field, with no type introspection. A type that cannot be carried in JSON
is refused at registration, naming the field.

Mapping between Python values and JSON (publish encodes with
:func:`.payloads.to_plain`, delivery decodes with the functions here):

- ``str``, ``bool``, ``None``: string, true/false, null; type-checked.
- ``int``: a number without fraction (``bool`` is refused); ``float``: a
  number (an integer is accepted and becomes a float).
- ``datetime.datetime``: an RFC 3339 string, ``isoformat()`` (a naive
  datetime has no offset and comes back naive); ``date`` / ``time``:
  ``YYYY-MM-DD`` / ``HH:MM:SS[.ffffff]``. Decoded with ``fromisoformat``.
- ``uuid.UUID``: its string; ``decimal.Decimal``: its exact string
  (``"1.10"``), a JSON number is accepted too.
- ``enum.Enum`` subclasses: the member's value, decoded with ``Cls(value)``.
- dataclasses and ``TypedDict``: an object of their fields, decoded field by
  field (unknown keys are ignored, as Go's decoder does; a missing field
  without default is an error); pydantic models: ``model_dump(mode="json")``,
  decoded with ``model_validate``.
- ``list[T]``, ``tuple[T, ...]``, ``tuple[A, B]``, ``set[T]``,
  ``frozenset[T]``: an array, item by item; ``dict[str, T]``: an object,
  value by value.
- ``Optional[T]``, ``A | B``: as the member; decoded with the first member
  that fits. ``Literal[...]``: checked. ``Any`` and bare ``list``/``dict``:
  as is.

A value that does not fit raises :class:`DecodeError` naming the field path
(``location.lat: expected float, got str``; ``readings[3].at``,
``by_sensor['kitchen']``).
"""

from __future__ import annotations

import collections.abc as cabc
import dataclasses
import datetime
import decimal
import enum
import types
import typing
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["DecodeError", "build_decoder"]

Decoder = Callable[[Any], Any]


class DecodeError(Exception):
    """A JSON value does not fit its declared type; ``path`` is built while
    the error travels up through the enclosing fields."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self._parts: list[str] = []  # innermost first

    def at(self, part: str) -> DecodeError:
        """Prepends one path step (``.name``, ``[3]`` or ``['key']``)."""
        self._parts.append(part)
        return self

    @property
    def path(self) -> str:
        return "".join(reversed(self._parts)).lstrip(".")

    def __str__(self) -> str:
        path = self.path
        return f"{path}: {self.message}" if path else self.message


class UnsupportedType(TypeError):
    """A registered class has a field whose type cannot be carried in JSON."""


def _got(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or repr(tp)


def _is_pydantic_model(cls: Any) -> bool:
    return isinstance(cls, type) and callable(getattr(cls, "model_validate", None)) and callable(
        getattr(cls, "model_dump", None)
    )


def build_decoder(tp: Any) -> Decoder:
    """The decoder of ``tp`` (a dataclass, pydantic model or TypedDict and
    everything they contain). Raises :class:`UnsupportedType` naming the
    field whose type JSON cannot carry."""
    return _Builder().build(tp, _name(tp))


# -- leaves -----------------------------------------------------------------------


def _identity(v: Any) -> Any:
    return v


def _exact(tp: type, expected: str) -> Decoder:
    def dec(v: Any) -> Any:
        if type(v) is not tp:
            raise DecodeError(f"expected {expected}, got {_got(v)}")
        return v

    return dec


def _float(v: Any) -> float:
    t = type(v)
    if t is float:
        return v  # type: ignore[no-any-return]
    if t is int:
        return float(v)
    raise DecodeError(f"expected float, got {_got(v)}")


def _none(v: Any) -> None:
    if v is not None:
        raise DecodeError(f"expected null, got {_got(v)}")


def _from_string(parse: Callable[[str], Any], expected: str) -> Decoder:
    def dec(v: Any) -> Any:
        if type(v) is not str:
            raise DecodeError(f"expected {expected} string, got {_got(v)}")
        try:
            return parse(v)
        except (ValueError, TypeError) as exc:
            raise DecodeError(f"expected {expected} string, got {v!r} ({exc})") from None

    return dec


def _decimal(v: Any) -> decimal.Decimal:
    t = type(v)
    try:
        if t is str or t is int:
            return decimal.Decimal(v)
        if t is float:
            return decimal.Decimal(repr(v))
    except decimal.InvalidOperation:
        raise DecodeError(f"expected a decimal number, got {v!r}") from None
    raise DecodeError(f"expected a decimal string or number, got {_got(v)}")


def _enum(cls: type[enum.Enum]) -> Decoder:
    values = ", ".join(repr(m.value) for m in cls)

    def dec(v: Any) -> Any:
        try:
            return cls(v)
        except (ValueError, TypeError):
            raise DecodeError(f"{v!r} is not a {cls.__name__} value ({values})") from None

    return dec


def _literal(args: tuple[Any, ...]) -> Decoder:
    allowed = set(args)

    def dec(v: Any) -> Any:
        try:
            ok = v in allowed and any(type(v) is type(a) for a in args if a == v)
        except TypeError:
            ok = False
        if not ok:
            raise DecodeError(f"expected one of {', '.join(map(repr, args))}, got {v!r}")
        return v

    return dec


_LEAVES: dict[Any, Decoder] = {
    str: _exact(str, "str"),
    int: _exact(int, "int"),
    bool: _exact(bool, "bool"),
    float: _float,
    type(None): _none,
    None: _none,
    Any: _identity,
    object: _identity,
    datetime.datetime: _from_string(datetime.datetime.fromisoformat, "an RFC 3339 date-time"),
    datetime.date: _from_string(datetime.date.fromisoformat, "an ISO 8601 date"),
    datetime.time: _from_string(datetime.time.fromisoformat, "an ISO 8601 time"),
    uuid.UUID: _from_string(uuid.UUID, "a UUID"),
    decimal.Decimal: _decimal,
    list: _exact(list, "list"),
    dict: _exact(dict, "object"),
}

# -- containers ---------------------------------------------------------------------


def _sequence(item: Decoder, make: Callable[[Any], Any]) -> Decoder:
    def dec(v: Any) -> Any:
        if type(v) is not list:
            raise DecodeError(f"expected list, got {_got(v)}")
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item(x))
            except DecodeError as exc:
                raise exc.at(f"[{i}]") from None
        return make(out)

    return dec


def _fixed_tuple(items: list[Decoder]) -> Decoder:
    n = len(items)

    def dec(v: Any) -> Any:
        if type(v) is not list or len(v) != n:
            raise DecodeError(f"expected a list of {n} items, got {_got(v)} {v!r:.40}")
        out = []
        for i, (d, x) in enumerate(zip(items, v, strict=True)):
            try:
                out.append(d(x))
            except DecodeError as exc:
                raise exc.at(f"[{i}]") from None
        return tuple(out)

    return dec


def _mapping(value: Decoder) -> Decoder:
    def dec(v: Any) -> Any:
        if type(v) is not dict:
            raise DecodeError(f"expected object, got {_got(v)}")
        out = {}
        for k, x in v.items():
            try:
                out[k] = value(x)
            except DecodeError as exc:
                raise exc.at(f"[{k!r}]") from None
        return out

    return dec


def _union(members: list[Decoder], names: list[str], nullable: bool) -> Decoder:
    only = members[0] if len(members) == 1 else None

    def dec(v: Any) -> Any:
        if v is None and nullable:
            return None
        if only is not None:
            return only(v)
        for m in members:
            try:
                return m(v)
            except DecodeError:
                continue
        expected = " | ".join(names + (["None"] if nullable else []))
        raise DecodeError(f"expected {expected}, got {_got(v)}")

    return dec


_SEQUENCES: dict[Any, Callable[[Any], Any]] = {
    list: list,
    cabc.Sequence: list,
    cabc.MutableSequence: list,
    cabc.Iterable: list,
    cabc.Collection: list,
    set: set,
    cabc.Set: frozenset,
    cabc.MutableSet: set,
    frozenset: frozenset,
}
_MAPPINGS = (dict, cabc.Mapping, cabc.MutableMapping)


# -- classes --------------------------------------------------------------------------


@dataclasses.dataclass
class _Field:
    name: str
    decode: Decoder
    required: bool


def _record(make: Callable[[dict[str, Any]], Any], fields: list[_Field], what: str) -> Decoder:
    def dec(v: Any) -> Any:
        if type(v) is not dict:
            raise DecodeError(f"expected a JSON object for {what}, got {_got(v)}")
        kwargs = {}
        for f in fields:
            if f.name in v:
                try:
                    kwargs[f.name] = f.decode(v[f.name])
                except DecodeError as exc:
                    raise exc.at(f".{f.name}") from None
            elif f.required:
                raise DecodeError(f"missing field {f.name!r} of {what}")
        try:
            return make(kwargs)
        except DecodeError:
            raise
        except Exception as exc:  # the class's own checks (__post_init__)
            raise DecodeError(f"{what}: {type(exc).__name__}: {exc}") from None

    return dec


def _pydantic(cls: Any) -> Decoder:
    def dec(v: Any) -> Any:
        try:
            return cls.model_validate(v)
        except Exception as exc:
            errors = getattr(exc, "errors", None)
            if not callable(errors):
                raise DecodeError(f"{type(exc).__name__}: {exc}") from None
            first = errors()[0] if errors() else {"loc": (), "msg": str(exc)}
            err = DecodeError(f"{first.get('msg')} (got {first.get('input', v)!r:.60})")
            for part in reversed(first.get("loc", ())):
                err.at(f"[{part}]" if isinstance(part, int) else f".{part}")
            raise err from None

    return dec


class _Builder:
    def __init__(self) -> None:
        self.cache: dict[Any, Decoder] = {}

    def hints(self, cls: Any, where: str) -> dict[str, Any]:
        try:
            return typing.get_type_hints(cls)
        except Exception as exc:
            raise UnsupportedType(
                f"{where}: cannot resolve the type hints ({exc}); the classes named in "
                "string annotations must be importable from the class's module (define "
                "them at module level)"
            ) from None

    def build(self, tp: Any, where: str) -> Decoder:
        try:
            if tp in self.cache:
                return self.cache[tp]
            if tp in _LEAVES:
                return _LEAVES[tp]
        except TypeError:  # unhashable annotation
            pass
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return _enum(tp)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self.cached(tp, lambda: self.dataclass(tp, where))
        if _is_pydantic_model(tp):
            return _pydantic(tp)
        if typing.is_typeddict(tp):
            return self.cached(tp, lambda: self.typeddict(tp, where))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Annotated:
            return self.build(args[0], where)
        if origin is typing.Literal:
            return _literal(args)
        if origin is typing.Union or origin is types.UnionType:
            members = [a for a in args if a is not type(None)]
            decoders = [self.build(a, where) for a in members]
            return _union(decoders, [_name(a) for a in members], len(members) < len(args))
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return _sequence(self.build(args[0], f"{where}[]"), tuple)
            if args == ((),) or not args:
                return _fixed_tuple([])
            return _fixed_tuple([self.build(a, f"{where}[{i}]") for i, a in enumerate(args)])
        if origin in _SEQUENCES:
            item = self.build(args[0], f"{where}[]") if args else _identity
            return _sequence(item, _SEQUENCES[origin])
        if origin in _MAPPINGS:
            if args and args[0] not in (str, Any):
                raise UnsupportedType(
                    f"{where}: JSON object keys are strings; use dict[str, ...], not {tp!r}"
                )
            return _mapping(self.build(args[1], f"{where}[]") if args else _identity)
        if tp in (tuple, set, frozenset):
            return _sequence(_identity, _SEQUENCES.get(tp, tuple))
        raise UnsupportedType(
            f"{where}: {_name(tp)} cannot be carried in a JSON payload (supported: str, int, "
            "float, bool, None, datetime, date, time, UUID, Decimal, Enum, dataclasses, "
            "pydantic models, TypedDict, list/tuple/set, dict[str, T], Optional/Union, "
            "Literal, Any)"
        )

    def cached(self, tp: Any, make: Callable[[], Decoder]) -> Decoder:
        """Builds a class decoder once; a recursive reference meets a forwarder."""
        cell: list[Decoder] = []
        self.cache[tp] = lambda v: cell[0](v)
        cell.append(make())
        self.cache[tp] = cell[0]
        return cell[0]

    def dataclass(self, cls: Any, where: str) -> Decoder:
        hints = self.hints(cls, where)
        fields = [
            _Field(
                f.name,
                self.build(hints.get(f.name, Any), f"{where}.{f.name}"),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
            if f.init
        ]
        return _record(lambda kw: cls(**kw), fields, cls.__name__)

    def typeddict(self, cls: Any, where: str) -> Decoder:
        hints = self.hints(cls, where)
        required = getattr(cls, "__required_keys__", frozenset(hints))
        fields = [
            _Field(name, self.build(tp, f"{where}.{name}"), name in required)
            for name, tp in hints.items()
        ]
        return _record(dict, fields, cls.__name__)
