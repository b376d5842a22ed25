"""The Arrow paths of the Spark data source, without a Spark session: the
engine's column encoder writes the same payloads as the Python row encoder,
and the engine's column reader with Arrow's JSON parsing gives the same
values as the per-value Python conversion (which it falls back to)."""

from __future__ import annotations

import datetime
import itertools
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

import keyop_messenger as km
from keyop_messenger import _core
from keyop_messenger.spark.mapping import RowEncoder
from keyop_messenger.spark.reader import KeyopPartition, _read_partition, stream_end

UTC = datetime.timezone.utc

SCHEMA = StructType(
    [
        StructField("s", StringType()),
        StructField("i16", ShortType()),
        StructField("i32", IntegerType()),
        StructField("i64", LongType()),
        StructField("f32", FloatType()),
        StructField("f64", DoubleType()),
        StructField("ok", BooleanType()),
        StructField("day", DateType()),
        StructField("at", TimestampType()),
        StructField("wall", TimestampNTZType()),
    ]
)


def sample() -> pa.RecordBatch:
    n = 40
    return pa.RecordBatch.from_arrays(
        [
            pa.array([None if i % 7 == 0 else f'é"\\\n{i}\t\u2028' for i in range(n)]),
            pa.array([i - 20 for i in range(n)], pa.int16()),
            pa.array([None if i % 5 == 0 else -(2**31) + i for i in range(n)], pa.int32()),
            pa.array([2**63 - 1 - i for i in range(n)], pa.int64()),
            pa.array([0.1 * i for i in range(n)], pa.float32()),
            pa.array(
                [math.nan, math.inf, -math.inf, 1e16, 1e-7, -0.0]
                + [i / 3 for i in range(n - 6)],
                pa.float64(),
            ),
            pa.array([None if i % 3 == 0 else i % 2 == 0 for i in range(n)]),
            pa.array([datetime.date(1969, 12, 25) + datetime.timedelta(days=i) for i in range(n)]),
            pa.array(
                [-1_500_000 + i * 1_000_123 for i in range(n)], pa.timestamp("us", tz="UTC")
            ),
            pa.array([1_774_915_200_000_000 + i * 10 for i in range(n)], pa.timestamp("us")),
        ],
        names=SCHEMA.fieldNames(),
    )


def test_engine_encodes_columns_as_the_row_encoder_does() -> None:
    encoder = RowEncoder(SCHEMA)
    for batch in (sample(), sample().slice(3, 30)):  # a slice: buffers start before its rows
        columns = encoder.arrow_columns(batch)
        assert columns is not None
        encoded = _core.encode_columns("t", columns, batch.num_rows, id_prefix="j:1:", first_row=5)
        assert len(encoded) == batch.num_rows
        expected = [json.loads(json.dumps(p)) for p in encoder.from_arrow(batch)]
        assert [json.loads(p) for p in encoded.payloads()] == expected


def test_arrow_buffers_are_read_in_place_and_only_immutable_ones() -> None:
    """The engine reads immutable ``pyarrow.Buffer``s in place (what Spark's
    batches hold) and bytes alike; a mutable buffer could change under the
    engine, so it is copied by ``arrow_columns`` and refused by the engine
    when passed as is, as is anything that is not a buffer."""
    whole = sample()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, whole.schema) as out:  # as Spark hands batches over
        out.write_batch(whole)
    batch = pa.ipc.open_stream(sink.getvalue()).read_next_batch().slice(3, 30)
    columns = RowEncoder(SCHEMA).arrow_columns(batch)
    assert columns is not None
    assert any(isinstance(b, pa.Buffer) for c in columns for b in c[3:])
    as_bytes = [
        (*c[:3], *(b.to_pybytes() if isinstance(b, pa.Buffer) else b for b in c[3:]))
        for c in columns
    ]
    in_place = _core.encode_columns("t", columns, 30).payloads()
    assert in_place == _core.encode_columns("t", as_bytes, 30).payloads()

    text = pa.array(["a", "bc"])
    _, offsets, data = text.buffers()
    mutable = pa.py_buffer(bytearray(data.to_pybytes()))
    assert mutable.is_mutable
    array = pa.Array.from_buffers(pa.string(), 2, [None, offsets, mutable])
    copied = RowEncoder(StructType([StructField("s", StringType())])).arrow_columns(
        pa.RecordBatch.from_arrays([array], names=["s"])
    )
    assert copied is not None
    assert isinstance(copied[0][4], bytes) and copied[0][4] == data.to_pybytes()
    with pytest.raises(km.PayloadTypeError, match=r"immutable pyarrow\.Buffer"):
        _core.encode_columns("t", [("s", "utf8", 0, None, mutable, offsets)], 2)
    with pytest.raises(km.PayloadTypeError, match="bytearray"):
        _core.encode_columns("t", [("s", "utf8", 0, None, bytearray(b"abc"), offsets)], 2)


def test_types_the_engine_does_not_encode_go_through_python() -> None:
    schema = StructType([StructField("d", DecimalType(10, 2))])
    batch = pa.RecordBatch.from_arrays([pa.array([None], pa.decimal128(10, 2))], names=["d"])
    assert RowEncoder(schema).arrow_columns(batch) is None


def test_published_batches_carry_their_ids(tmp_path: Path) -> None:
    encoder = RowEncoder(SCHEMA)
    batch = sample()
    columns = encoder.arrow_columns(batch)
    assert columns is not None
    encoded = _core.encode_columns("t", columns, batch.num_rows, id_prefix="j:1:", first_row=5)
    with km.Messenger(
        km.Config.from_dict({"name": "n", "storage": {"data_dir": str(tmp_path)}})
    ) as m:
        ids = m._engine.publish_batch("c", encoded, None, None)
    assert ids == [f"j:1:{5 + i}" for i in range(batch.num_rows)]
    stored = list(km.read_channel(tmp_path, "c"))
    assert [e.message.id for e in stored] == ids
    assert [e.message.payload for e in stored] == [json.loads(p) for p in encoded.payloads()]


def test_records_encoded_in_one_pass_store_what_a_publish_stores(tmp_path: Path) -> None:
    """``encode_records`` frames each payload straight into its record (a
    data_dir task does this before it takes the directory lock, then only
    appends): the records a ``publish_batch`` of the same payloads stores,
    the same checks, and only the instance named as origin may append them."""
    columns = RowEncoder(SCHEMA).arrow_columns(sample().slice(3, 30))
    assert columns is not None
    framed = _core.encode_records("t", columns, 30, origin="n", channel="c", id_prefix="j:2:",
                                  first_row=7, service_name="svc", correlation_id="k")  # fmt: skip
    assert (len(framed), framed.channel, framed.first_id, framed.last_id) == (
        30, "c", "j:2:7", "j:2:36"
    )
    payloads = _core.encode_columns("t", columns, 30, id_prefix="j:2:", first_row=7)
    config = {"name": "n", "storage": {"data_dir": str(tmp_path / "framed")}}
    with km.Messenger(km.Config.from_dict(config)) as m:
        m._engine.publish_framed(framed)
        # Publishing moved the records out: a second publish is refused,
        # while the batch still reports what it held.
        with pytest.raises(RuntimeError, match="already handed to publish_framed"):
            m._engine.publish_framed(framed)
        assert (len(framed), framed.first_id, framed.last_id) == (30, "j:2:7", "j:2:36")
    config = {"name": "n", "storage": {"data_dir": str(tmp_path / "published")}}
    with km.Messenger(km.Config.from_dict(config)) as m:
        m._engine.publish_batch("c", payloads, "svc", "k")

    def fields(name: str) -> list[tuple[Any, ...]]:
        return [(e.message.id, e.message.origin, e.message.channel, e.message.payload_type,
                 e.message.service_name, e.message.correlation_id, e.message.payload)
                for e in km.read_channel(tmp_path / name, "c")]  # fmt: skip

    assert fields("framed") == fields("published")
    assert [f[0] for f in fields("framed")] == [f"j:2:{7 + i}" for i in range(30)]

    config = {"name": "other", "storage": {"data_dir": str(tmp_path / "other")}}
    with km.Messenger(km.Config.from_dict(config)) as m, pytest.raises(
        km.InvalidNameError, match=r'origin "n" .* instance "other"'
    ):
        m._engine.publish_framed(_core.encode_records("t", columns, 30, origin="n", channel="c",
                                                      id_prefix="j:2:"))  # fmt: skip
    with pytest.raises(km.InvalidNameError, match="channel"):
        _core.encode_records("t", columns, 1, origin="n", channel="c.dead-letter", id_prefix="j:")
    with pytest.raises(km.InvalidNameError, match="id"):
        _core.encode_records("t", columns, 1, origin="n", channel="c", id_prefix="bad id ")
    with pytest.raises(km.InvalidNameError, match="id"):
        _core.encode_records("t", columns, 1, origin="n", channel="c", id_prefix="x" * 65)
    with pytest.raises(km.InvalidNameError, match="payload_type"):
        _core.encode_records("t\n", columns, 1, origin="n", channel="c", id_prefix="j:")
    big = pa.RecordBatch.from_arrays([pa.array(["x" * _core.MAX_RECORD_BYTES])], names=["s"])
    big_columns = RowEncoder(StructType([StructField("s", StringType())])).arrow_columns(big)
    assert big_columns is not None
    with pytest.raises(km.MessageTooLargeError):
        _core.encode_records("t", big_columns, 1, origin="n", channel="c", id_prefix="j:")
    assert not (tmp_path / "other" / "channels" / "c").exists()


def test_data_dir_write_frames_ahead_with_each_chunks_correlation_id(tmp_path: Path) -> None:
    from keyop_messenger.spark.writer import WriteSpec, publish_arrow

    schema = StructType([StructField("n", LongType())])
    batches = [pa.RecordBatch.from_arrays([pa.array(range(10), pa.int64())], names=["n"])]
    options = {"data_dir": str(tmp_path), "channel": "c", "payload_type": "t", "batch_size": "4",
               "name": "writer-1", "service_name": "svc", "correlation_id": "run-7"}  # fmt: skip
    commit = publish_arrow(WriteSpec.from_options(options, schema, streaming=False), batches, "j")
    assert (commit.rows, commit.batches) == (10, 3)
    assert (commit.first_id, commit.last_id) == ("j:0:0", "j:0:9")
    stored = [e.message for e in km.read_channel(tmp_path, "c")]
    assert [(m.id, m.payload["n"]) for m in stored] == [(f"j:0:{i}", i) for i in range(10)]
    assert {(m.origin, m.service_name, m.correlation_id) for m in stored} == {
        ("writer-1", "svc", "run-7")
    }


def read_schema(payload: Any) -> StructType:
    text = StringType()
    return StructType(
        [StructField("id", text), StructField("ts", TimestampType())]
        + [StructField(n, text) for n in
           ("channel", "origin", "payload_type", "service_name", "correlation_id")]
        + [StructField("payload", payload), StructField("segment", LongType()),
           StructField("offset", LongType())]
    )  # fmt: skip


@pytest.mark.parametrize("bad", [False, True])
def test_payload_schema_parsed_by_arrow_matches_python(tmp_path: Path, bad: bool) -> None:
    payload = StructType(
        [
            StructField("n", LongType()),
            StructField("x", DoubleType()),
            StructField("s", StringType()),
            StructField("at", TimestampType()),
            StructField("ok", BooleanType()),
        ]
    )
    items = [
        ("t", {"n": i, "x": i / 4, "s": f"v{i}", "at": f"2026-03-31T00:00:0{i % 10}.5Z",
               "ok": i % 2 == 0, "extra": [1]})
        for i in range(50)
    ]  # fmt: skip
    items[7] = ("t", {"n": 7})  # missing keys: nulls
    if bad:  # a value Arrow refuses: this batch is converted in Python (the value is null)
        items[9] = ("t", {"n": "not a number", "x": 1, "s": 5})
    with km.Messenger(
        km.Config.from_dict({"name": "n", "storage": {"data_dir": str(tmp_path)}})
    ) as m:
        m.publish_batch("c", items, correlation_id="cid")
    part = KeyopPartition(0, 0, 0, stream_end(str(tmp_path), "c"), "c")
    got = [
        row
        for b in _read_partition(str(tmp_path), "c", part, read_schema(payload))
        for row in b.to_pylist()
    ]
    texts = [
        row
        for b in _read_partition(str(tmp_path), "c", part, read_schema(StringType()))
        for row in b.to_pylist()
    ]
    assert len(got) == len(texts) == 50
    assert [r["correlation_id"] for r in got] == ["cid"] * 50
    assert [json.loads(r["payload"]) for r in texts] == [p for _, p in items]
    first = got[0]["payload"]
    assert first == {
        "n": 0, "x": 0.0, "s": "v0",
        "at": datetime.datetime(2026, 3, 31, 0, 0, 0, 500000, tzinfo=UTC), "ok": True,
    }  # fmt: skip
    assert got[7]["payload"] == {"n": 7, "x": None, "s": None, "at": None, "ok": None}
    if bad:
        assert got[9]["payload"] == {"n": None, "x": 1.0, "s": "5", "at": None, "ok": None}


def test_data_dir_write_resumes_after_the_rows_a_failed_attempt_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks encoded ahead while another holds the directory lock, chunks
    appended as they come when it is free, and the resume point of a
    retried attempt: every row once, also when the retry's chunks straddle
    the rows already committed, and the rows committed counted exactly."""
    from keyop_messenger.spark import writer
    from keyop_messenger.spark.writer import PartitionError, WriteSpec, publish_arrow

    schema = StructType([StructField("n", LongType())])
    batches = [
        pa.RecordBatch.from_arrays([pa.array(range(lo, lo + 4000), pa.int64())], names=["n"])
        for lo in range(0, 20_000, 4000)
    ]

    def spec(batch_size: int) -> WriteSpec:
        options = {"data_dir": str(tmp_path), "channel": "c", "payload_type": "t",
                   "batch_size": str(batch_size)}  # fmt: skip
        return WriteSpec.from_options(options, schema, streaming=False)

    def failing() -> Any:
        yield from batches[:3]
        raise RuntimeError("the task dies")

    holder = km.Messenger(km.Config.from_dict({"storage": {"data_dir": str(tmp_path)}}))
    with pytest.raises(PartitionError, match="after committing 0 rows"):
        publish_arrow(spec(1000), failing(), "job0")  # died encoding ahead of the lock
    assert not (tmp_path / "channels" / "c").exists()
    with monkeypatch.context() as patch:
        patch.setattr(writer, "ENCODE_AHEAD_BYTES", 1)  # one chunk ahead, then as it comes
        threading.Timer(0.3, holder.close).start()  # the lock frees while the task waits
        with pytest.raises(PartitionError, match="after committing 12000 rows in 12 batches"):
            publish_arrow(spec(1000), failing(), "job1")
    assert len(list(km.read_channel(tmp_path, "c"))) == 12_000
    # A free directory: appended as the rows come; chunk 10000-15000 straddles.
    commit = publish_arrow(spec(5000), iter(batches), "job1")
    assert (commit.skipped, commit.rows) == (12_000, 20_000)
    stored = list(km.read_channel(tmp_path, "c"))
    assert [e.message.id for e in stored] == [f"job1:0:{i}" for i in range(20_000)]
    assert [e.message.payload["n"] for e in stored] == list(range(20_000))


def _slow_batches(lo: int, count: int, pulled: list[int] | None = None) -> Any:
    """``count`` batches of 500 rows of ``n`` from ``lo``, a little apart (as
    a task's rows come from Spark); each batch pulled is counted in ``pulled``."""
    for i in range(count):
        time.sleep(0.003)
        if pulled is not None:
            pulled.append(i)
        start = lo + i * 500
        yield pa.RecordBatch.from_arrays(
            [pa.array(range(start, start + 500), pa.int64())], names=["n"]
        )


def _dir_spec(tmp_path: Path, batch_size: int = 500) -> Any:
    from keyop_messenger.spark.writer import WriteSpec

    options = {"data_dir": str(tmp_path), "channel": "c", "payload_type": "t",
               "batch_size": str(batch_size)}  # fmt: skip
    return WriteSpec.from_options(options, StructType([StructField("n", LongType())]),
                                  streaming=False)  # fmt: skip


def test_data_dir_tasks_take_turns_on_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tasks writing into one data directory at once take turns on its
    lock: their chunks interleave in the channel (neither waits for the
    other to finish), and every row is there once, in order within its task."""
    from keyop_messenger.spark import writer

    monkeypatch.setattr(writer, "MIN_TURN_S", 0.02)
    monkeypatch.setattr(writer, "TURN_POLL_S", 0.002)
    tasks = threading.local()
    monkeypatch.setattr(writer, "_task_info", lambda: (tasks.partition, 0, None, None))
    spec = _dir_spec(tmp_path)
    commits: dict[int, Any] = {}
    errors: list[BaseException] = []

    def task(partition: int) -> None:
        tasks.partition = partition
        try:
            batches = _slow_batches(partition * 100_000, 60)
            commits[partition] = writer.publish_arrow(spec, batches, "job")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=task, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert [commits[p].rows for p in (0, 1)] == [30_000, 30_000]
    ids = [e.message.id for e in km.read_channel(tmp_path, "c")]
    for p in (0, 1):
        assert [i for i in ids if i.startswith(f"job:{p}:")] == [
            f"job:{p}:{i}" for i in range(30_000)
        ]
    parts = [i.split(":")[1] for i in ids]
    switches = sum(1 for a, b in itertools.pairwise(parts) if a != b)
    assert switches >= 3, f"the tasks did not take turns ({switches} switches)"


def test_data_dir_task_waiting_for_its_turn_encodes_no_more_than_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task that gave the directory up to another writer which then keeps
    it encodes ahead up to its budget, then waits for the lock (it does not
    take the whole partition into memory); it writes everything once the
    directory is free again."""
    import fcntl

    from keyop_messenger.errors import DataDirLockedError
    from keyop_messenger.spark import writer

    monkeypatch.setattr(writer, "ENCODE_AHEAD_BYTES", 20 * 500 * 8)  # about 20 batches
    monkeypatch.setattr(writer, "MIN_TURN_S", 0.0)
    spec = _dir_spec(tmp_path)
    pulled: list[int] = []
    done: list[Any] = []
    thread = threading.Thread(
        target=lambda: done.append(writer.publish_arrow(spec, _slow_batches(0, 100, pulled), "j"))
    )
    config = km.Config.from_dict({"storage": {"data_dir": str(tmp_path)}})
    holder: km.Messenger | None = None
    thread.start()
    try:
        # Another writer waits for its turn (as a task does), then keeps the directory.
        for _ in range(500):
            if (tmp_path / "spark-progress" / "waiting.lock").exists():
                break
            time.sleep(0.002)
        with open(tmp_path / "spark-progress" / "waiting.lock", "rb") as waiting:
            fcntl.flock(waiting, fcntl.LOCK_SH)
            for _ in range(5000):
                try:
                    holder = km.Messenger(config)
                    break
                except DataDirLockedError:
                    time.sleep(0.001)
        assert holder is not None, "the task never gave the directory up"
        taken_at = len(pulled)
        # Wait (bounded) until the task stops pulling batches.
        last, still = -1, 0
        for _ in range(300):
            time.sleep(0.02)
            still = still + 1 if len(pulled) == last else 0
            last = len(pulled)
            if still >= 10:
                break
        assert len(pulled) < 100 and len(pulled) - taken_at <= 25, (taken_at, len(pulled))
    finally:
        if holder is not None:
            holder.close()
        thread.join(60)
    assert len(pulled) == 100 and done and done[0].rows == 50_000
    assert [e.message.payload["n"] for e in km.read_channel(tmp_path, "c")] == list(range(50_000))


def test_min_partitions_splits_a_read_at_record_boundaries(tmp_path: Path) -> None:
    from keyop_messenger.spark.reader import BatchReader, ReadSpec

    with km.Messenger(
        km.Config.from_dict({"name": "n", "storage": {"data_dir": str(tmp_path)}})
    ) as m:
        m.publish_batch("c", [("t", {"i": i}) for i in range(300)])
    options = {"data_dir": str(tmp_path), "channel": "c"}
    schema = read_schema(StringType())
    assert len(BatchReader(ReadSpec.all_from_options(options, schema)).partitions()) == 1
    reader = BatchReader(ReadSpec.all_from_options({**options, "minPartitions": "4"}, schema))
    parts = reader.partitions()
    assert 4 <= len(parts) <= 5
    got = [
        json.loads(p)["i"]
        for part in parts
        for b in reader.read(part)
        for p in b.column("payload").to_pylist()
    ]
    assert got == list(range(300))
