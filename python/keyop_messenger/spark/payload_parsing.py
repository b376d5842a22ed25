"""Payload JSON to Arrow arrays of a ``payload_schema``, three ways that
give the same results: the engine for flat schemas of plain values
(:func:`flat_payloads`), Arrow's JSON reader (:func:`arrow_parses`), and
:func:`~keyop_messenger.spark.mapping.json_to_spark`, the rule, for the rest."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampType,
)

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]


#: The engine's kind (``_core.parse_payload_fields``) of each type of a
#: top-level payload field it parses.
FLAT_KINDS: dict[type[DataType], str] = {
    StringType: "utf8",
    BooleanType: "bool",
    ByteType: "int8",
    ShortType: "int16",
    IntegerType: "int32",
    LongType: "int64",
    FloatType: "float32",
    DoubleType: "float64",
    TimestampType: "timestamp_utc",
}


def arrow_parses(dtype: DataType) -> bool:
    """Whether Arrow's JSON reader parses values of ``dtype`` as
    :func:`json_to_spark` does when it accepts them at all (it refuses, and
    the batch falls back to Python, whenever a value does not fit): structs
    and arrays of the plain types of :data:`FLAT_KINDS`."""
    if isinstance(dtype, StructType):
        return all(arrow_parses(f.dataType) for f in dtype.fields)
    if isinstance(dtype, ArrayType):
        return arrow_parses(dtype.elementType)
    return isinstance(dtype, tuple(FLAT_KINDS))


@functools.cache
def _arrow_types() -> dict[str, pa.DataType]:
    """The Arrow type of each of the engine's kinds (the values of :data:`FLAT_KINDS`)."""
    import pyarrow as pa

    return {
        "utf8": pa.string(), "bool": pa.bool_(), "int8": pa.int8(), "int16": pa.int16(),
        "int32": pa.int32(), "int64": pa.int64(), "float32": pa.float32(),
        "float64": pa.float64(), "timestamp_utc": pa.timestamp("us", tz="UTC"),
    }  # fmt: skip


def flat_kinds(dtype: DataType) -> list[tuple[str, str]] | None:
    """``(name, kind)`` of each field of the payload struct ``dtype`` when
    the engine can parse them all (top-level fields of the types in
    :data:`FLAT_KINDS`), else None."""
    if not isinstance(dtype, StructType) or not dtype.fields:
        return None
    kinds = [(f.name, FLAT_KINDS.get(type(f.dataType))) for f in dtype.fields]
    return [(n, k) for n, k in kinds if k is not None] if all(k for _, k in kinds) else None


def flat_payloads(
    data: bytes, rows: int, kind: pa.DataType, flat: list[tuple[str, str]]
) -> pa.Array | None:
    """The payloads parsed by the engine (plain values only: it gives up,
    returning None, on any other, so :func:`json_to_spark` stays the rule)."""
    import pyarrow as pa

    from .. import _core

    parsed = _core.parse_payload_fields(data, rows, flat)
    if parsed is None:
        return None
    arrow_types = _arrow_types()
    fields = [kind.field(i) for i in range(kind.num_fields)]
    arrays = []
    for f, (_, k), (values, offsets, validity, nulls) in zip(fields, flat, parsed, strict=True):
        bufs = [None if validity is None else pa.py_buffer(validity)]
        if offsets is not None:
            bufs.append(pa.py_buffer(offsets))
        bufs.append(pa.py_buffer(values))
        a = pa.Array.from_buffers(arrow_types[k], rows, bufs, null_count=nulls)
        arrays.append(a if a.type == f.type else a.cast(f.type))
    return pa.StructArray.from_arrays(arrays, fields=fields)


def parse_payloads(
    data: bytes,
    lines: pa.Array,
    rows: int,
    kind: pa.DataType,
    parse: Any,
    fast: bool,
    flat: list[tuple[str, str]] | None = None,
) -> pa.Array:
    """The payloads (JSON lines ``data``, also as the string array ``lines``)
    as an array of the struct type ``kind``: parsed by the engine when every
    field is ``flat`` and every value plain, else by Arrow's JSON reader
    when ``fast``, else (or when Arrow refuses a value) by ``parse``."""
    import pyarrow as pa
    import pyarrow.json as pj  # type: ignore[import-untyped]

    if flat and rows:
        parsed = flat_payloads(data, rows, kind, flat)
        if parsed is not None:
            return parsed
    if fast and rows:
        fields = [kind.field(i) for i in range(kind.num_fields)]
        try:
            table = pj.read_json(
                pa.BufferReader(pa.py_buffer(data)),
                read_options=pj.ReadOptions(use_threads=False, block_size=len(data) + 1),
                parse_options=pj.ParseOptions(
                    explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore"
                ),
            )
            if table.num_rows == rows and fields:
                arrays = [table.column(f.name).combine_chunks().cast(f.type) for f in fields]
                return pa.StructArray.from_arrays(arrays, fields=fields)
        except (pa.ArrowException, ValueError, TypeError, KeyError):
            pass  # a value Arrow will not take: Python converts this batch
    return pa.array([parse(json.loads(s)) for s in lines.to_pylist()], kind)
