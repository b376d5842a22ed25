"""Deep payload decoding (client-API issue, item 5): registered types with
nested dataclasses and pydantic models, enums, dates, UUIDs, decimals,
optionals, unions, lists and dicts come back exactly as published, through
``read_channel`` and ``subscribe``; a payload that does not fit names the
field path; a type JSON cannot carry fails before anything is written."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import threading
import typing
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, Optional, TypedDict, Union

import pydantic
import pytest

import keyop_messenger as km
from keyop_messenger import ChannelNotFoundError, Config, Message, Messenger, PayloadTypeError

UTC = datetime.timezone.utc
WAIT_S = 10.0


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass
class Location:
    lat: float
    lon: float


class Probe(pydantic.BaseModel):
    serial: uuid.UUID
    calibrated: datetime.datetime
    offset: Decimal
    location: Location  # a dataclass inside a pydantic model


@dataclasses.dataclass
class Reading:
    sensor: str
    location: Location
    unit: Unit
    level: Level
    at: datetime.datetime
    day: datetime.date
    clock: datetime.time
    id: uuid.UUID
    price: Decimal
    note: Optional[str]  # noqa: UP045 - the typing.Optional spelling on purpose
    either: int | str
    tags: list[str]
    history: list[Location]
    by_name: dict[str, Location]
    maybe: Union[Location, None] = None  # noqa: UP007 - the typing.Union spelling on purpose
    pair: tuple[int, Unit] = (0, Unit.C)
    flags: frozenset[int] = frozenset()
    mode: Literal["auto", "manual"] = "auto"
    probe: Probe | None = None
    extra: Any = None


class Batch(pydantic.BaseModel):
    """A pydantic model holding dataclasses."""

    readings: list[Reading]
    taken: datetime.date


@dataclasses.dataclass
class Tree:
    name: str
    children: list[Tree] = dataclasses.field(default_factory=list)


class Sample(TypedDict):
    at: datetime.datetime
    amount: Decimal
    unit: Unit


def reading(**over: Any) -> Reading:
    base = Reading(
        sensor="kitchen",
        location=Location(52.52, 13.405),
        unit=Unit.F,
        level=Level.HIGH,
        at=datetime.datetime(2026, 11, 25, 15, 4, 5, 123456, tzinfo=UTC),
        day=datetime.date(2026, 2, 28),
        clock=datetime.time(23, 59, 58, 7),
        id=uuid.UUID("01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f"),
        price=Decimal("1.10"),
        note=None,
        either="seven",
        tags=["a", "b"],
        history=[Location(1.0, 2.0), Location(-3.5, 4.25)],
        by_name={"hall": Location(0.0, 0.5)},
        maybe=Location(9.0, 8.0),
        pair=(3, Unit.C),
        flags=frozenset({3, 1, 2}),
        mode="manual",
        probe=Probe(
            serial=uuid.UUID(int=7),
            calibrated=datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.timezone(
                datetime.timedelta(hours=5, minutes=30))),
            offset=Decimal("-0.000100"),
            location=Location(0.1, 0.2),
        ),
        extra={"free": [1, "form"]},
    )
    return dataclasses.replace(base, **over)


@pytest.fixture
def m(tmp_path: Path) -> typing.Iterator[Messenger]:
    with Messenger(Config.from_dict({"name": "t", "storage": {"data_dir": str(tmp_path)}})) as m:
        yield m


def read_back(m: Messenger, channel: str = "c") -> list[Any]:
    return [e.message.payload for e in m.read_channel(channel)]


def raw_back(m: Messenger, channel: str = "c") -> list[Any]:
    """The payloads as stored: plain JSON data (no registry)."""
    return [e.message.payload for e in km.read_channel(m.config.storage.data_dir, channel)]


def subscribe_back(m: Messenger, n: int, channel: str = "c") -> list[Any]:
    got: list[Any] = []
    done = threading.Event()

    def handler(msg: Message) -> None:
        got.append(msg.payload)
        if len(got) == n:
            done.set()

    sub = m.subscribe(channel, "s", handler)
    try:
        return got if done.wait(WAIT_S) else pytest.fail(f"only {len(got)} of {n} delivered")
    finally:
        sub.close()


# -- round trips ------------------------------------------------------------------


def test_nested_dataclass_round_trips_exactly(m: Messenger) -> None:
    m.register_payload_type("demo.Reading", Reading)
    variants = [
        reading(),
        reading(note="fine", either=7, maybe=None, probe=None, flags=frozenset()),
        reading(at=datetime.datetime(2026, 1, 2, 3, 4, 5)),  # naive stays naive
        reading(price=Decimal("12345678901234567890.000000001"), unit=Unit.C),
    ]
    sub_ids = m.subscribe("c", "s", lambda msg: None)  # starts at the end: before publishing
    sub_ids.close()
    for r in variants:
        m.publish("c", "demo.Reading", r)
    for got in (read_back(m), subscribe_back(m, len(variants))):
        assert got == variants
        for g, want in zip(got, variants, strict=True):
            assert type(g.unit) is Unit and type(g.level) is Level
            assert str(g.price) == str(want.price), "Decimal keeps its exact digits"
            assert g.at.tzinfo == want.at.tzinfo
            assert type(g.either) is type(want.either)
            assert isinstance(g.history[0], Location) and isinstance(g.pair, tuple)
            assert g.probe is None or isinstance(g.probe.location, Location)


def test_json_form_of_each_type(m: Messenger) -> None:
    m.register_payload_type("demo.Reading", Reading)
    m.publish("c", "demo.Reading", reading())
    (raw,) = raw_back(m)
    assert raw["at"] == "2026-11-25T15:04:05.123456+00:00"  # RFC 3339
    assert raw["day"] == "2026-02-28" and raw["clock"] == "23:59:58.000007"
    assert raw["id"] == "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f"
    assert raw["price"] == "1.10"
    assert raw["unit"] == "fahrenheit" and raw["level"] == 2  # enums by value
    assert raw["location"] == {"lat": 52.52, "lon": 13.405}
    assert raw["pair"] == [3, "celsius"] and sorted(raw["flags"]) == [1, 2, 3]
    assert raw["probe"]["calibrated"] == "2026-01-01T12:00:00+05:30"
    assert raw["probe"]["offset"] == "-0.000100"


def test_pydantic_model_with_nested_dataclasses_round_trips(m: Messenger) -> None:
    m.register_payload_type("demo.Batch", Batch)
    batch = Batch(readings=[reading(), reading(either=1)], taken=datetime.date(2026, 3, 1))
    m.publish("c", "demo.Batch", batch)
    (got,) = read_back(m)
    assert got == batch and isinstance(got.readings[0].location, Location)


def test_recursive_dataclass_and_typeddict(m: Messenger) -> None:
    m.register_payload_type("demo.Tree", Tree)
    m.register_payload_type("demo.Sample", Sample)
    tree = Tree("root", [Tree("a", [Tree("a1")]), Tree("b")])
    sample: Sample = {"at": datetime.datetime(2026, 5, 6, tzinfo=UTC), "amount": Decimal("0.5"),
                      "unit": Unit.C}
    m.publish("c", "demo.Tree", tree)
    m.publish("c", "demo.Sample", sample)
    assert read_back(m) == [tree, sample]


def test_payloads_written_by_another_publisher_decode(m: Messenger) -> None:
    """A Go publisher writes numbers where we write strings: ``Z`` offsets,
    integer floats and numeric decimals decode too."""
    sample = {"at": "2026-03-31T14:22:01.123456Z", "amount": 3, "unit": "celsius",
              "unknown_key": "ignored"}
    m.publish("c", "demo.Sample", sample)  # published unregistered: as another publisher would
    m.publish("c", "demo.Location", {"lat": 1, "lon": 2})
    m.register_payload_type("demo.Sample", Sample)
    m.register_payload_type("demo.Location", Location)
    got = read_back(m)
    assert got[0] == {"at": datetime.datetime(2026, 3, 31, 14, 22, 1, 123456, tzinfo=UTC),
                      "amount": Decimal(3), "unit": Unit.C}
    assert got[1] == Location(1.0, 2.0) and type(got[1].lat) is float


def test_registered_plain_dict_is_untouched(m: Messenger) -> None:
    m.register_payload_type("demo.Raw", dict)
    payload = {"at": "2026-01-01T00:00:00Z", "price": "1.10", "n": [1, {"x": None}]}
    m.publish("c", "demo.Raw", payload)
    (got,) = read_back(m)
    assert got == payload and type(got["at"]) is str


# -- payloads that do not fit -------------------------------------------------------


def good_raw() -> dict[str, Any]:
    return {
        "sensor": "k", "location": {"lat": 1.0, "lon": 2.0}, "unit": "celsius", "level": 1,
        "at": "2026-01-01T00:00:00Z", "day": "2026-01-01", "clock": "00:00:00",
        "id": str(uuid.UUID(int=1)), "price": "1", "note": None, "either": 1, "tags": [],
        "history": [], "by_name": {},
    }  # fmt: skip


BAD = [
    ({"location": {"lat": "north", "lon": 2.0}}, "location.lat: expected float, got str"),
    ({"location": {"lon": 2.0}}, "location: missing field 'lat' of Location"),
    ({"history": [{"lat": 1.0, "lon": 2.0}, {"lat": 1.0, "lon": None}]},
     "history[1].lon: expected float, got null"),
    ({"by_name": {"hall": {"lat": True, "lon": 0.0}}},
     "by_name['hall'].lat: expected float, got bool"),
    ({"unit": "kelvin"}, "unit: 'kelvin' is not a Unit value ('celsius', 'fahrenheit')"),
    ({"level": 3}, "level: 3 is not a Level value (1, 2)"),
    ({"at": "yesterday"}, "at: expected an RFC 3339 date-time string, got 'yesterday'"),
    ({"id": 5}, "id: expected a UUID string, got int"),
    ({"price": "cheap"}, "price: expected a decimal number, got 'cheap'"),
    ({"either": 1.5}, "either: expected int | str, got float"),
    ({"note": 3}, "note: expected str, got int"),
    ({"tags": "a,b"}, "tags: expected list, got str"),
    ({"pair": [1, "celsius", 3]}, "pair: expected a list of 2 items"),
    ({"mode": "off"}, "mode: expected one of 'auto', 'manual', got 'off'"),
    ({"maybe": {"lat": 1.0, "lon": "x"}}, "maybe.lon: expected float, got str"),
    ({"probe": {"serial": str(uuid.UUID(int=2)), "calibrated": "2026-01-01T00:00:00Z",
                "offset": "1", "location": {"lat": "x", "lon": 1.0}}},
     "probe.location.lat: "),
    ({"sensor": None}, "sensor: expected str, got null"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_payload_that_does_not_fit_names_the_field_path(
    m: Messenger, change: dict[str, Any], message: str
) -> None:
    m.publish("c", "demo.Reading", {**good_raw(), **change})  # not registered yet
    m.publish("c", "demo.Reading", good_raw())
    m.register_payload_type("demo.Reading", Reading)
    entries = m.read_channel("c")
    with pytest.raises(PayloadTypeError) as err:
        next(entries)
    prefix = "payload of type 'demo.Reading' does not decode into Reading: "
    assert str(err.value).startswith(prefix), str(err.value)
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("name", "cls", "payload", "message"),
    [
        ("demo.Location", Location, Location("x", 2.0), "lat: expected float, got str"),  # type: ignore[arg-type]
        ("demo.Reading", Reading, None, "location.lat: expected float, got str"),
        ("demo.Sample", Sample, {"at": "2026-01-01T00:00:00Z", "amount": "1", "unit": "kelvin"},
         "unit: "),
        ("demo.Sample", Sample, {"amount": "1", "unit": "celsius"}, "at"),
    ],
    ids=["dataclass-field", "nested-field", "typeddict-value", "typeddict-missing-key"],
)  # fmt: skip
def test_publish_refuses_a_payload_whose_fields_do_not_fit(
    m: Messenger, name: str, cls: type, payload: Any, message: str
) -> None:
    """Checked at publish as a subscriber will decode it: nothing is stored
    that every reader would then dead-letter or stop at."""
    m.register_payload_type(name, cls)
    if payload is None:
        payload = reading(location=Location("x", 1.0))  # type: ignore[arg-type]
    with pytest.raises(PayloadTypeError, match=f"does not fit {cls.__name__}: .*{message}"):
        m.publish("c", name, payload)
    with pytest.raises(PayloadTypeError):
        m.publish_batch("c", [(name, payload)])
    assert m.stream_end("c") == 0  # nothing was stored


def test_subscriber_dead_letters_with_the_field_path(m: Messenger) -> None:
    m.subscribe("c", "s", lambda msg: None).close()  # the id starts at offset 0
    m.publish("c", "demo.Location", {"lat": 1.0, "lon": [2.0]})  # not registered yet
    m.publish("c", "demo.Location", {"lat": 1.0, "lon": 2.0})
    m.register_payload_type("demo.Location", Location)
    assert subscribe_back(m, 1) == [Location(1.0, 2.0)]
    (dead,) = raw_back(m, "c.dead-letter")
    assert "lon: expected float, got list" in dead["last_error"], dead
    assert dead["original"]["payload"] == {"lat": 1.0, "lon": [2.0]}


# -- types that cannot be carried ---------------------------------------------------


@dataclasses.dataclass
class HoldsALock:
    name: str
    lock: threading.Lock  # type: ignore[valid-type]


@dataclasses.dataclass
class IntKeys:
    by_id: dict[int, str]


@dataclasses.dataclass
class Inner:
    socket: object.__class__  # a metaclass: not a JSON type


@dataclasses.dataclass
class Outer:
    inner: list[Inner]


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (HoldsALock, "HoldsALock.lock: "),
        (IntKeys, "IntKeys.by_id: JSON object keys are strings"),
        (Outer, "Outer.inner[].socket: type cannot be carried in a JSON payload"),
    ],
)
def test_type_json_cannot_carry_is_refused_at_registration(
    m: Messenger, cls: type, message: str
) -> None:
    with pytest.raises(PayloadTypeError) as err:
        m.register_payload_type("demo.Bad", cls)
    assert message in str(err.value), str(err.value)
    assert m._registry.registered("demo.Bad") is None


@dataclasses.dataclass
class Loose:
    name: str
    value: Any


def test_value_that_cannot_be_encoded_fails_before_anything_is_written(m: Messenger) -> None:
    m.register_payload_type("demo.Loose", Loose)
    with pytest.raises(PayloadTypeError, match="cannot be encoded as JSON"):
        m.publish("c", "demo.Loose", Loose("x", object()))
    with pytest.raises(PayloadTypeError):
        m.publish_batch("c", [("demo.Loose", Loose("ok", 1)), ("demo.Loose", Loose("x", b"raw"))])
    assert m.stream_end("c") == 0
    with pytest.raises(ChannelNotFoundError):  # nothing was written: not even the channel
        raw_back(m)


def test_decoder_is_built_once_at_registration(
    m: Messenger, monkeypatch: pytest.MonkeyPatch
) -> None:
    m.register_payload_type("demo.Reading", Reading)

    def no_introspection(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("type hints resolved while decoding a message")

    monkeypatch.setattr(typing, "get_type_hints", no_introspection)
    for _ in range(3):
        m.publish("c", "demo.Reading", reading())
    assert read_back(m) == [reading()] * 3


def test_unresolvable_annotation_is_refused_at_registration(m: Messenger) -> None:
    @dataclasses.dataclass
    class LocalInner:
        x: int

    @dataclasses.dataclass
    class LocalOuter:
        inner: LocalInner  # a string annotation naming a function-local class

    with pytest.raises(PayloadTypeError, match=r"LocalOuter: cannot resolve the type hints"):
        m.register_payload_type("demo.LocalOuter", LocalOuter)
    m.register_payload_type("demo.LocalInner", LocalInner)  # builtins resolve anywhere
    m.publish("c", "demo.LocalInner", LocalInner(3))
    assert read_back(m) == [LocalInner(3)]
