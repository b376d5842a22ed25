"""The engine's payload parser (``_core.parse_payload_fields``), the Spark
reader's fast path for a flat ``payload_schema``, held to the rule it must
follow: :func:`json_to_spark` applied to ``json.loads`` of each payload.
Values it does not take make it give up on the batch, which the general
conversion then handles; the result must be the same either way."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    ByteType,
    DateType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from keyop_messenger import _core
from keyop_messenger.spark.mapping import json_to_spark
from keyop_messenger.spark.payload_parsing import flat_kinds, flat_payloads, parse_payloads
from keyop_messenger.spark.reader import _arrow_schema

PAYLOAD = StructType(
    [
        StructField("s", StringType()),
        StructField("b", BooleanType()),
        StructField("i8", ByteType()),
        StructField("i16", ShortType()),
        StructField("i32", IntegerType()),
        StructField("i64", LongType()),
        StructField("f32", FloatType()),
        StructField("f64", DoubleType()),
        StructField("at", TimestampType()),
    ]
)

#: Per field: JSON values the engine must take (plain values of the field's
#: type), then values it may refuse (the general conversion decides).
VALUES: dict[str, tuple[list[str], list[str]]] = {
    "s": (['"plain"', '""', r'"esc\"aped\n\t"', r'"\u00e9\ud83d\ude00"', '"é 😀"', "null"],
          ["5", "true", '{"a":[1]}', "[1,2]", r'"lone \ud800"']),
    "b": (["true", "false", "null"], ["1", '"true"', "0"]),
    "i8": (["127", "-128", "0", "-0"], ["128", "-129", "1.0", '"3"', "1e2", "true"]),
    "i16": (["32767", "-32768"], ["32768", "-32769", "2.5"]),
    "i32": (["2147483647", "-2147483648"], ["2147483648", "-2147483649"]),
    "i64": (["9223372036854775807", "-9223372036854775808", "42"],
            ["9223372036854775808", "-9223372036854775809", "1e3", '" 7"']),
    "f32": (["1.1", "3.4028235e38", "-2.5e-3", "7", "16777217"],
            ["1e39", '"1.5"', '"NaN"', "false"]),
    "f64": (["0.1", "1e308", "-0.0", "123456789012345678901", "5e-324", "0.30000000000000004"],
            ["1e400", '"Infinity"', '"2.5"', "[0.5]"]),
    "at": (['"2026-03-31T00:00:00.5Z"', '"2026-03-31"', '"2026-03-31 01:02:03+05:30"',
            '"2026-03-31T00:00:00.1234567-0800"', '"1969-12-31T23:59:59.999999z"',
            '"2024-02-29t12:00"', '"9999-12-31T23:59:59.999999Z"'],
           ['"2026-02-30"', '"0001-01-01T00:00:00+01:00"', '"2026-03-31T00:00:00+24:00"',
            '" 2026-03-31"', '"2026-03-31T00:00:00 Z"', "1774915200", r'"2026-03-31\u0054"',
            '"today"', '"2026-03-31T23:59:60Z"']),
}  # fmt: skip

KIND = _arrow_schema(StructType([StructField("payload", PAYLOAD)])).field(0).type
FLAT = flat_kinds(PAYLOAD)
PARSE = json_to_spark(PAYLOAD)


def by_python(lines: list[str]) -> str:
    """What the general conversion makes of ``lines``: the rule (as ``repr``,
    so NaN equals NaN and -0.0 differs from 0.0)."""
    return repr(pa.array([PARSE(json.loads(s)) for s in lines], KIND).to_pylist())


def by_reader(lines: list[str]) -> str:
    """What the reader makes of ``lines``, engine first."""
    data = "".join(s + "\n" for s in lines).encode()
    got = parse_payloads(data, pa.array(lines), len(lines), KIND, PARSE, False, FLAT)
    return repr(got.to_pylist())


def by_engine(lines: list[str]) -> str | None:
    data = "".join(s + "\n" for s in lines).encode()
    assert FLAT is not None
    got = flat_payloads(data, len(lines), KIND, FLAT)
    return None if got is None else repr(got.to_pylist())


def test_every_flat_type_is_parsed_by_the_engine() -> None:
    assert FLAT == [(f.name, k) for f, k in zip(PAYLOAD.fields, [
        "utf8", "bool", "int8", "int16", "int32", "int64", "float32", "float64", "timestamp_utc",
    ], strict=True)]  # fmt: skip
    assert flat_kinds(StructType([StructField("d", DateType())])) is None
    assert flat_kinds(StructType([StructField("a", ArrayType(LongType()))])) is None
    assert flat_kinds(StructType([])) is None
    assert flat_kinds(StringType()) is None


@pytest.mark.parametrize("field", list(VALUES))
def test_each_value_reads_as_the_python_conversion_reads_it(field: str) -> None:
    plain, other = VALUES[field]
    for value in plain + other:
        lines = [f'{{"{field}":{value}}}']
        assert by_reader(lines) == by_python(lines), value
        if value in plain:
            assert by_engine(lines) == by_python(lines), f"the engine refused {value}"
    # A refused value anywhere in a batch hands the whole batch over.
    for value in other:
        assert by_engine([f'{{"{field}":{plain[0]}}}', f'{{"{field}":{value}}}']) is None, value


def test_random_batches_read_as_the_python_conversion_reads_them() -> None:
    rng = random.Random(20261127)
    engine_batches = 0
    for _ in range(300):
        plain_only = rng.random() < 0.5
        lines = []
        for _ in range(rng.randint(1, 12)):
            members = []
            for field, (plain, other) in VALUES.items():
                for _ in range(rng.choice([0, 1, 1, 1, 2])):  # missing, once, repeated
                    pool = plain if plain_only or rng.random() < 0.9 else other
                    members.append(f'"{field}":{rng.choice(pool)}')
            if rng.random() < 0.3:
                members.append('"extra":{"nested":[1,"x",null]}')
            rng.shuffle(members)
            lines.append("{" + ",".join(members) + "}")
        expected = by_python(lines)
        assert by_reader(lines) == expected, lines
        if plain_only:
            assert by_engine(lines) == expected, lines
            engine_batches += 1
    assert engine_batches > 100


def test_the_engine_refuses_what_is_not_an_object_of_the_rows_given() -> None:
    assert FLAT is not None
    for data, rows in [(b"[1]\n", 1), (b'"x"\n', 1), (b"null\n", 1), (b'{"s":"a"}\n', 2),
                       (b'{"s":"a"}\n{"s":"b"}\n', 1)]:  # fmt: skip
        assert _core.parse_payload_fields(data, rows, FLAT) is None, data
    with pytest.raises(Exception, match="not supported"):
        _core.parse_payload_fields(b"{}\n", 1, [("d", "date32")])


def test_decimals_keep_every_digit_their_column_holds() -> None:
    """DECIMAL(38, s) holds 38 digits; rounding to the scale used Python's
    default 28-digit context, so longer values (Spark infers decimal(38,18)
    for Decimal) read as null. Values that do not fit stay null."""
    from decimal import Decimal

    from pyspark.sql.types import DecimalType

    parse = json_to_spark(StructType([StructField("d", DecimalType(38, 18))]))
    assert parse({"d": "12345678901.500000000000000000"}) == {"d": Decimal("12345678901.5")}
    assert parse({"d": "12345678901234567890.123456789012345678"}) == {
        "d": Decimal("12345678901234567890.123456789012345678")
    }
    assert parse({"d": "-0.0000000000000000005"}) == {"d": Decimal("-1E-18")}  # half up
    assert parse({"d": "1" + "0" * 20}) == {"d": None}  # 21 integer digits: does not fit
    ten = json_to_spark(StructType([StructField("d", DecimalType(38, 10))]))
    assert ten({"d": "12345678901234567890.0123456789"}) == {
        "d": Decimal("12345678901234567890.0123456789")
    }
