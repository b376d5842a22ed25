"""Mapping between JSON payloads and Spark values: rows to JSON objects
(:class:`RowEncoder`, used by the writers) and JSON to the types of a
``payload_schema`` (:func:`json_to_spark`, used by the readers)."""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    NullType,
    Row,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]


_UTC = datetime.timezone.utc
#: Rounding a decimal to its column's scale: the default context keeps 28
#: digits, fewer than a DECIMAL(38, s) holds (its values then read as null).
_DECIMAL_CONTEXT = decimal.Context(prec=80)
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=_UTC)


_TS_RE = re.compile(
    r"^(\d{4})-(\d\d)-(\d\d)(?:[Tt ](\d\d):(\d\d)(?::(\d\d)(?:\.(\d+))?)?)?"
    r"\s*(Z|z|[+-]\d\d(?::?\d\d)?)?$"
)


def _parse_timestamp(text: str, *, keep_zone: bool) -> datetime.datetime | None:
    """RFC 3339 / ISO 8601 text (any number of fraction digits, ``Z`` or an
    offset; no zone means UTC) to a datetime: aware UTC with ``keep_zone``,
    else the naive wall-clock time."""
    m = _TS_RE.match(text.strip())
    if not m:
        return None
    year, month, day, hh, mm, ss, frac, zone = m.groups()
    micros = int((frac or "0")[:6].ljust(6, "0"))
    try:
        dt = datetime.datetime(
            int(year), int(month), int(day), int(hh or 0), int(mm or 0), int(ss or 0), micros
        )
    except ValueError:
        return None
    if not keep_zone:
        return dt
    if zone and zone not in ("Z", "z"):
        sign = 1 if zone[0] == "+" else -1
        digits = zone[1:].replace(":", "")
        delta = datetime.timedelta(hours=int(digits[:2]), minutes=int(digits[2:4] or 0))
        try:
            return dt.replace(tzinfo=datetime.timezone(sign * delta)).astimezone(_UTC)
        except (ValueError, OverflowError):  # an offset of a day or more, or past year 1-9999
            return None
    return dt.replace(tzinfo=_UTC)


_INT_RANGES = {
    ByteType: (-(2**7), 2**7 - 1),
    ShortType: (-(2**15), 2**15 - 1),
    IntegerType: (-(2**31), 2**31 - 1),
    LongType: (-(2**63), 2**63 - 1),
}


_SPECIAL_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf,
                   "+Infinity": math.inf, "inf": math.inf, "-inf": -math.inf}  # fmt: skip


def _without_surrogates(text: str) -> str:
    r"""``text`` with each lone surrogate (a JSON ``\ud800`` escape without
    its pair, which UTF-8 cannot hold) replaced by U+FFFD, as Go's decoder
    does."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def json_to_spark(dtype: DataType) -> Callable[[Any], Any]:
    """A function turning a JSON value into a Python value Arrow accepts for
    ``dtype``; values that do not fit become ``None``."""
    if isinstance(dtype, StructType):
        fields = [(f.name, json_to_spark(f.dataType)) for f in dtype.fields]

        def struct(v: Any) -> Any:
            if not isinstance(v, dict):
                return None
            return {name: conv(v.get(name)) for name, conv in fields}

        return struct
    if isinstance(dtype, ArrayType):
        elem = json_to_spark(dtype.elementType)
        return lambda v: [elem(x) for x in v] if isinstance(v, list) else None
    if isinstance(dtype, MapType):
        key = json_to_spark(dtype.keyType)
        val = json_to_spark(dtype.valueType)

        def mapping(v: Any) -> Any:
            if not isinstance(v, dict):
                return None
            out = []
            for k, x in v.items():
                kk = key(k)
                if kk is not None:
                    out.append((kk, val(x)))
            return out

        return mapping
    if isinstance(dtype, StringType):

        def text(v: Any) -> Any:
            if v is None or isinstance(v, str):
                return v and _without_surrogates(v)
            return json.dumps(v, ensure_ascii=False, separators=(",", ":"))

        return text
    if isinstance(dtype, BooleanType):
        return lambda v: v if isinstance(v, bool) else None
    for cls, (lo, hi) in _INT_RANGES.items():
        if isinstance(dtype, cls):

            def integer(v: Any, lo: int = lo, hi: int = hi) -> Any:
                if isinstance(v, bool) or v is None:
                    return None
                try:
                    if isinstance(v, float):
                        if not v.is_integer():
                            return None
                        v = int(v)
                    elif isinstance(v, str):
                        v = int(v.strip())
                    elif not isinstance(v, int):
                        return None
                except (ValueError, OverflowError):
                    return None
                return v if lo <= v <= hi else None

            return integer
    if isinstance(dtype, (FloatType, DoubleType)):

        def floating(v: Any) -> Any:
            if isinstance(v, bool) or v is None:
                return None
            if isinstance(v, (int, float)):
                return float(v)
            if isinstance(v, str):
                if v in _SPECIAL_FLOATS:
                    return _SPECIAL_FLOATS[v]
                try:
                    return float(v)
                except ValueError:
                    return None
            return None

        return floating
    if isinstance(dtype, DecimalType):
        quantum = decimal.Decimal(1).scaleb(-dtype.scale)
        limit = decimal.Decimal(10) ** (dtype.precision - dtype.scale)

        def dec(v: Any) -> Any:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                return None
            try:
                d = decimal.Decimal(str(v).strip()).quantize(
                    quantum, rounding=decimal.ROUND_HALF_UP, context=_DECIMAL_CONTEXT
                )
            except (decimal.InvalidOperation, ValueError):
                return None
            return d if d.is_finite() and abs(d) < limit else None

        return dec
    if isinstance(dtype, DateType):

        def date(v: Any) -> Any:
            if not isinstance(v, str):
                return None
            dt = _parse_timestamp(v, keep_zone=False)
            return dt.date() if dt is not None else None

        return date
    if isinstance(dtype, TimestampType):

        def timestamp(v: Any) -> Any:
            if isinstance(v, str):
                return _parse_timestamp(v, keep_zone=True)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                try:
                    return _EPOCH + datetime.timedelta(seconds=v)
                except OverflowError:
                    return None
            return None

        return timestamp
    if isinstance(dtype, TimestampNTZType):
        return lambda v: _parse_timestamp(v, keep_zone=False) if isinstance(v, str) else None
    if isinstance(dtype, BinaryType):

        def binary(v: Any) -> Any:
            if not isinstance(v, str):
                return None
            try:
                return base64.b64decode(v, validate=True)
            except ValueError:
                return None

        return binary
    return lambda v: None  # NullType and types JSON cannot carry


def _float_to_json(v: Any) -> Any:
    if v is None or math.isfinite(v):
        return v
    if math.isnan(v):
        return "NaN"
    return "Infinity" if v > 0 else "-Infinity"


def _wall_clock(dt: datetime.datetime) -> str:
    text = (
        f"{dt.year:04d}-{dt.month:02d}-{dt.day:02d}T{dt.hour:02d}:{dt.minute:02d}:{dt.second:02d}"
    )
    if dt.microsecond:
        text += f".{dt.microsecond:06d}".rstrip("0")
    return text


def format_timestamp(value: datetime.datetime) -> str:
    """RFC 3339 UTC text of a ``TIMESTAMP`` value (a naive value is local
    time, as PySpark hands them out), microseconds trimmed of trailing zeros."""
    return _wall_clock(value.astimezone(_UTC)) + "Z"


def _timestamp_to_json(v: Any) -> Any:
    return None if v is None else format_timestamp(v)


def _timestamp_ntz_to_json(v: Any) -> Any:
    return None if v is None else _wall_clock(v)


def _date_to_json(v: Any) -> Any:
    return None if v is None else v.isoformat()


def _decimal_to_json(v: Any) -> Any:
    return None if v is None else format(v, "f")


def _binary_to_json(v: Any) -> Any:
    return None if v is None else base64.b64encode(bytes(v)).decode("ascii")


def _key_to_json(k: Any) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, bool):
        return "true" if k else "false"
    if isinstance(k, float):
        return str(_float_to_json(k))
    if isinstance(k, datetime.datetime):
        return k.isoformat()
    if isinstance(k, (datetime.date, decimal.Decimal)):
        return k.isoformat() if isinstance(k, datetime.date) else format(k, "f")
    return str(k)


def _other_to_json(v: Any) -> Any:
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, datetime.timedelta):
        return str(v)
    return str(v)


_Conv = Callable[[Any], Any]


def _spark_to_json(dtype: DataType) -> _Conv | None:
    """A function turning a value of ``dtype`` (as PySpark or pyarrow hands
    it out) into JSON-ready data, or ``None`` when the value already is."""
    if isinstance(dtype, StructType):
        fields = [(f.name, _spark_to_json(f.dataType)) for f in dtype.fields]
        names = [n for n, _ in fields]

        def struct(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, Row):
                v = dict(zip(names, v, strict=False))
            elif not isinstance(v, dict):
                v = dict(zip(names, v, strict=False))
            return {n: (c(v.get(n)) if c is not None else v.get(n)) for n, c in fields}

        return struct
    if isinstance(dtype, ArrayType):
        elem = _spark_to_json(dtype.elementType)
        if elem is None:
            return lambda v: None if v is None else list(v)
        return lambda v: None if v is None else [elem(x) for x in v]
    if isinstance(dtype, MapType):
        val = _spark_to_json(dtype.valueType)

        def mapping(v: Any) -> Any:
            if v is None:
                return None
            items = v.items() if isinstance(v, dict) else v
            if val is None:
                return {_key_to_json(k): x for k, x in items}
            return {_key_to_json(k): val(x) for k, x in items}

        return mapping
    if isinstance(dtype, (FloatType, DoubleType)):
        return _float_to_json
    if isinstance(dtype, TimestampType):
        return _timestamp_to_json
    if isinstance(dtype, TimestampNTZType):
        return _timestamp_ntz_to_json
    if isinstance(dtype, DateType):
        return _date_to_json
    if isinstance(dtype, DecimalType):
        return _decimal_to_json
    if isinstance(dtype, BinaryType):
        return _binary_to_json
    if isinstance(
        dtype,
        (StringType, BooleanType, ByteType, ShortType, IntegerType, LongType, NullType),
    ):
        return None
    return _other_to_json


_UNCHANGED: Any = object()


def _arrow_column_to_json(col: Any, dtype: DataType) -> Any:
    """``col`` converted to its JSON form by Arrow kernels, ``_UNCHANGED`` if
    it needs no conversion, or ``None`` when Python must convert it."""
    import pyarrow as pa
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    try:
        if isinstance(dtype, (FloatType, DoubleType)):
            finite = pc.all(pc.is_finite(col)).as_py()
            return _UNCHANGED if finite in (True, None) else None
        if isinstance(dtype, DateType):
            return col.cast(pa.string())
        if isinstance(dtype, DecimalType):
            text = col.cast(pa.string())
            # Arrow writes tiny values as 1E-30; JSON gets plain notation.
            return None if pc.any(pc.match_substring(text, "E")).as_py() else text
        if isinstance(dtype, (TimestampType, TimestampNTZType)):
            if isinstance(dtype, TimestampType):
                if getattr(col.type, "tz", None) is None:
                    return None  # a naive TIMESTAMP is local time: Python knows the zone
                col = col.cast(pa.timestamp("us", tz="UTC"))
            else:
                col = col.cast(pa.timestamp("us"))
            text = pc.strftime(col, format="%Y-%m-%dT%H:%M:%S")  # seconds with 6 decimals
            text = pc.replace_substring_regex(text, pattern=r"(\.\d*?)0+$", replacement=r"\1")
            text = pc.replace_substring_regex(text, pattern=r"\.$", replacement="")
            if isinstance(dtype, TimestampType):
                text = pc.binary_join_element_wise(text, pa.scalar("Z"), "")
            return text
    except (pa.ArrowException, ValueError, TypeError):
        return None
    return None


def _readable(buf: Any) -> Any:
    """An Arrow buffer as the engine reads it: immutable ones (Spark's
    batches) in place, a mutable one copied."""
    if buf is None or not buf.is_mutable:
        return buf
    return buf.to_pybytes()


class RowEncoder:
    """Turns rows of a schema into payload dicts (see the module docs)."""

    def __init__(self, schema: StructType) -> None:
        names = schema.fieldNames()
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"keyop data source: duplicate column names {dupes}: a payload is a JSON "
                "object, so column names must be unique"
            )
        self.names = names
        self.schema = schema
        self.convs = [(f.name, _spark_to_json(f.dataType)) for f in schema.fields]
        self.active = [(n, c) for n, c in self.convs if c is not None]

    def __reduce__(self) -> tuple[Any, ...]:
        return (RowEncoder, (self.schema,))

    def from_arrow(self, batch: pa.RecordBatch) -> list[dict[str, Any]]:
        """The payload objects of an Arrow batch's rows, values converted to their JSON form."""
        # Top-level timestamps, dates, decimals and floats are converted by
        # Arrow compute kernels (several times faster than per value).
        fix: list[tuple[str, _Conv]] = []
        for i, (name, conv) in enumerate(self.convs):
            if conv is None:
                continue
            done = _arrow_column_to_json(batch.column(i), self.schema.fields[i].dataType)
            if done is None:
                fix.append((name, conv))
            elif done is not _UNCHANGED:
                batch = batch.set_column(i, name, done)
        rows: list[dict[str, Any]] = batch.to_pylist()
        for name, conv in fix:
            for r in rows:
                r[name] = conv(r[name])
        return rows

    def arrow_columns(self, batch: pa.RecordBatch) -> list[tuple[Any, ...]] | None:
        """The columns of ``batch`` as ``_core.encode_columns`` takes them
        (name, kind, offset, validity, data, offsets), or None when a column
        has a type the engine does not encode (structs, arrays, maps,
        decimals, binary, a TIMESTAMP without a zone): then the rows go
        through :meth:`from_arrow`."""
        import pyarrow.types as pt  # type: ignore[import-untyped]

        out: list[tuple[Any, ...]] = []
        for field, col in zip(self.schema.fields, batch.columns, strict=True):
            t, dtype = col.type, field.dataType
            if pt.is_boolean(t):
                kind = "bool"
            elif pt.is_signed_integer(t):
                kind = f"int{t.bit_width}"
            elif pt.is_floating(t) and t.bit_width in (32, 64):
                kind = f"float{t.bit_width}"
            elif pt.is_string(t) and isinstance(dtype, StringType):
                kind = "utf8"
            elif pt.is_date32(t) and isinstance(dtype, DateType):
                kind = "date32"
            elif pt.is_timestamp(t) and t.unit == "us":
                if isinstance(dtype, TimestampType) and t.tz is not None:
                    kind = "timestamp_utc"
                elif isinstance(dtype, TimestampNTZType) and t.tz is None:
                    kind = "timestamp_ntz"
                else:
                    return None
            else:
                return None
            bufs = [_readable(b) for b in col.buffers()]
            validity = bufs[0] if col.null_count else None
            if kind == "utf8":
                out.append((field.name, kind, col.offset, validity, bufs[2], bufs[1]))
            else:
                out.append((field.name, kind, col.offset, validity, bufs[1], None))
        return out

    def from_row(self, row: Any) -> dict[str, Any]:
        """The payload object of one Spark Row, values converted to their JSON form."""
        d = dict(zip(self.names, row, strict=False))
        for name, conv in self.active:
            d[name] = conv(d[name])
        return d
