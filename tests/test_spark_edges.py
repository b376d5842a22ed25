"""Loud edges of the Spark data source: unknown and mistyped options, missing
data directories and channels, data deleted before a stream read it.

One module-scoped ``local[2]`` SparkSession (slow to start); small data. As in
tests/test_spark.py, a missing pyspark/pyarrow/Java fails every test here.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import keyop_messenger as km
from keyop_messenger.errors import DataLossError

try:
    from pyspark.sql import SparkSession

    from keyop_messenger import spark as ks
    from keyop_messenger.spark.reader import ReadSpec
    from keyop_messenger.spark.streaming import StreamReader

    SPARK_PROBLEM: str | None = None
except ImportError as exc:  # pragma: no cover - CI installs pyspark
    SPARK_PROBLEM = f"pyspark 4.x and pyarrow are required: {exc}"

pytestmark = pytest.mark.filterwarnings(
    "ignore:PySpark does not yet fully support pandas:FutureWarning"
)

PAD = "p" * 2200  # about 470 records fill a 1 MiB segment


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    if SPARK_PROBLEM is not None:
        pytest.fail(f"Spark tests cannot run: {SPARK_PROBLEM}", pytrace=False)
    active = SparkSession.getActiveSession()
    if active is not None:  # tests/test_spark.py's session-wide one: share it, leave it open
        ks.register(active)
        yield active
        return
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    work = tmp_path_factory.mktemp("spark-edges")
    session = (
        SparkSession.builder.master("local[2]")
        .appName("keyop-messenger-edges")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.warehouse.dir", str(work / "warehouse"))
        .config("spark.driver.extraJavaOptions", f"-Dderby.system.home={work}")
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    ks.register(session)
    try:
        yield session
    finally:
        session.stop()


def two_segments(data_dir: Path, channel: str = "c", n: int = 600) -> list[int]:
    """Publishes ``n`` + 10 padded records (two 1 MiB segments for 600); returns the
    segment starts."""
    m = km.Messenger(
        km.Config.from_dict(
            {"name": "edges", "storage": {"data_dir": str(data_dir), "segment_size_mb": 1}}
        )
    )
    try:
        for first in range(0, n, 300):
            items = [("t", {"i": i, "pad": PAD}) for i in range(first, min(n, first + 300))]
            m.publish_batch(channel, items)
        m.publish_batch(channel, [("t", {"i": n + i, "pad": PAD}) for i in range(10)])
    finally:
        m.close()
    segments = ks.list_segments(str(data_dir), channel)
    assert len(segments) >= 2, segments
    return segments


def segment_file(data_dir: Path, channel: str, start: int) -> Path:
    return data_dir / "channels" / channel / f"{start:020d}.jsonl"


def count_records(path: Path) -> int:
    return path.read_bytes().count(b"\n")


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


def test_unknown_read_option_raises_with_did_you_mean(spark: SparkSession, tmp_path: Path) -> None:
    with pytest.raises(Exception) as info:
        spark.read.format("keyop").option("data_dir", str(tmp_path)).option(
            "chanel", "x"
        ).load().collect()
    text = str(info.value)
    assert "unknown option for a read: 'chanel' (did you mean 'channel'?)" in text
    assert "valid options are: data_dir, channel, start_offset" in text
    # A path given to load() would be ignored: it is refused too.
    with pytest.raises(Exception, match="unknown option for a read: 'path'"):
        spark.read.format("keyop").option("data_dir", str(tmp_path)).option(
            "channel", "x"
        ).load(str(tmp_path)).collect()


def test_unknown_write_option_raises_with_did_you_mean(
    spark: SparkSession, tmp_path: Path
) -> None:
    df = spark.range(3)
    with pytest.raises(Exception, match=r"'batchsize' \(did you mean 'batch_size'\?\)"):
        df.write.format("keyop").mode("append").option("data_dir", str(tmp_path)).option(
            "channel", "x"
        ).option("payload_type", "t").option("batchsize", "10").save()
    # A read option is not a write option.
    with pytest.raises(Exception, match="unknown option for a write: 'payload_schema'"):
        df.write.format("keyop").mode("append").option("data_dir", str(tmp_path)).option(
            "channel", "x"
        ).option("payload_type", "t").option("payload_schema", "a INT").save()
    assert not (tmp_path / "channels" / "x").exists(), "nothing is written on a bad option"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"data_dir": "FILE"}, "data_dir '.*' is a file, not a data directory"),
        ({"payload_type": "t\x01"}, "option 'payload_type': invalid payload_type"),
        ({"service_name": "s" * 300}, "option 'service_name': invalid service_name"),
        ({"correlation_id": "c\n"}, "option 'correlation_id': invalid correlation_id"),
        ({"sync_interval_ms": "-5"}, "storage.sync_interval_ms: must be >= 0"),
        ({"segment_size_mb": "1", "compaction_threshold_mb": "1"}, "set together with"),
    ],
    ids=["data-dir-file", "payload_type", "service_name", "correlation_id", "sync_interval",
         "both-sizes"],
)
def test_write_options_every_task_would_refuse_are_refused_when_planned(
    spark: SparkSession, tmp_path: Path, options: dict[str, str], message: str
) -> None:
    """Once, on the driver, naming the option: not as a failure of every task
    (and every retry of it)."""
    writer = spark.range(3).write.format("keyop").mode("append")
    (tmp_path / "file").write_text("")
    for key, value in {"data_dir": str(tmp_path), "channel": "x", "payload_type": "t",
                       **options}.items():  # fmt: skip
        writer = writer.option(key, str(tmp_path / "file") if value == "FILE" else value)
    with pytest.raises(Exception, match=message) as info:
        writer.save()
    assert "PartitionError" not in str(info.value), "refused by the tasks, not when planned"
    assert not (tmp_path / "channels" / "x").exists()


def test_wrongly_typed_option_names_option_value_and_type(
    spark: SparkSession, tmp_path: Path
) -> None:
    two_segments(tmp_path / "data")
    with pytest.raises(
        Exception, match=r"option 'failOnDataLoss' must be a boolean \(true or false\), got 'maybe'"
    ):
        spark.readStream.format("keyop").option("data_dir", str(tmp_path / "data")).option(
            "channel", "c"
        ).option("failOnDataLoss", "maybe").load().writeStream.format("memory").queryName(
            "typed"
        ).start().processAllAvailable()
    with pytest.raises(Exception, match=r"option 'allowMissing' must be a boolean.*got 'sure'"):
        spark.read.format("keyop").option("data_dir", str(tmp_path)).option(
            "channel", "c"
        ).option("allowMissing", "sure").load().collect()
    with pytest.raises(Exception, match=r"option 'batch_size' must be an integer, got 'ten'"):
        spark.range(3).write.format("keyop").mode("append").option(
            "data_dir", str(tmp_path)
        ).option("channel", "x").option("payload_type", "t").option("batch_size", "ten").save()


@pytest.mark.parametrize(
    ("ddl", "why"),
    [("a INTT", "field 1 .*has the unknown type 'INTT'"), ("a INT,", "field 2 .*is empty")],
)
def test_a_bad_payload_schema_names_the_option_and_the_field(
    spark: SparkSession, tmp_path: Path, ddl: str, why: str
) -> None:
    """Spark parses the option inside the envelope's DDL, so its own error
    pointed at the envelope's columns, not at the user's text."""
    two_segments(tmp_path / "data")
    with pytest.raises(Exception, match=f"option 'payload_schema' '{ddl}': {why}"):
        spark.read.format("keyop").option("data_dir", str(tmp_path / "data")).option(
            "channel", "c"
        ).option("payload_schema", ddl).load().collect()


# ---------------------------------------------------------------------------
# Missing data directory or channel
# ---------------------------------------------------------------------------


def test_missing_data_dir_or_channel_raises_unless_allow_missing(
    spark: SparkSession, tmp_path: Path
) -> None:
    def read(data_dir: Path, channel: str, **extra: str) -> Any:
        r = spark.read.format("keyop").option("data_dir", str(data_dir)).option("channel", channel)
        for k, v in extra.items():
            r = r.option(k, v)
        return r.load()

    with pytest.raises(Exception, match=r"DataDirNotFoundError.*does not exist"):
        read(tmp_path / "nope", "c").collect()
    tmp_path.joinpath("data").mkdir()
    with pytest.raises(Exception, match=r"ChannelNotFoundError.*channel 'c' does not exist"):
        read(tmp_path / "data", "c").collect()
    assert read(tmp_path / "nope", "c", allowMissing="true").count() == 0
    assert read(tmp_path / "data", "c", allowMissing="true").count() == 0
    assert not (tmp_path / "nope").exists(), "reading never creates a data directory"
    (tmp_path / "file").write_text("")
    for extra in ({}, {"allowMissing": "true"}):  # a file is not a missing directory
        with pytest.raises(Exception, match=r"data_dir '.*file' is a file, not a data directory"):
            read(tmp_path / "file", "c", **extra).collect()


def test_check_exists_names_the_error(tmp_path: Path) -> None:
    from keyop_messenger.errors import ChannelNotFoundError, DataDirNotFoundError
    from keyop_messenger.spark.reader import check_exists

    with pytest.raises(DataDirNotFoundError):
        check_exists(str(tmp_path / "nope"), "c", allow_missing=False)
    with pytest.raises(ChannelNotFoundError):
        check_exists(str(tmp_path), "c", allow_missing=False)
    assert check_exists(str(tmp_path), "c", allow_missing=True) is False


# ---------------------------------------------------------------------------
# Data deleted before a stream read it
# ---------------------------------------------------------------------------


def stream_reader(spark: SparkSession, data_dir: Path, **extra: str) -> StreamReader:
    options = {"data_dir": str(data_dir), "channel": "c", **extra}
    source = ks.KeyopDataSource(options)
    schema = spark.createDataFrame([], source.schema()).schema
    return StreamReader(ReadSpec.all_from_options(options, schema))


def test_stream_planning_over_deleted_data_raises_or_counts(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = tmp_path / "data"
    segments = two_segments(data_dir)
    reader = stream_reader(spark, data_dir)
    start = reader.initialOffset()
    end = reader.latestOffset(start)
    assert start == {"offset": 0}
    segment_file(data_dir, "c", segments[0]).unlink()  # as retention would
    with pytest.raises(DataLossError, match=rf"bytes \[0, {segments[1]}\) were deleted"):
        reader.partitions(start, end)

    lenient = stream_reader(spark, data_dir, failOnDataLoss="false")
    with caplog.at_level(logging.WARNING, logger="keyop_messenger.spark"):
        parts = lenient.partitions(start, end)
    assert parts and all(p.start >= segments[1] for p in parts)
    assert lenient.lost_bytes == segments[1] and lenient.lost_ranges == [(0, segments[1])]
    assert any("were deleted" in r.getMessage() for r in caplog.records)
    # "earliest" starts at the oldest record still stored: no loss to report.
    assert stream_reader(spark, data_dir).initialOffset() == {"offset": segments[1]}


def test_stream_read_of_a_segment_deleted_after_planning(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = tmp_path / "data"
    segments = two_segments(data_dir)
    reader = stream_reader(spark, data_dir)
    start = reader.initialOffset()
    parts = reader.partitions(start, reader.latestOffset(start))
    first = next(p for p in parts if p.segment == segments[0])
    segment_file(data_dir, "c", segments[0]).unlink()
    with pytest.raises(DataLossError, match="after the batch was planned"):
        list(reader.read(first))
    lenient = stream_reader(spark, data_dir, failOnDataLoss="false")
    with caplog.at_level(logging.WARNING, logger="keyop_messenger.spark"):
        assert list(lenient.read(first)) == []
    assert any("after the batch was planned" in r.getMessage() for r in caplog.records)
    # The next segment still reads whole.
    second = next(p for p in parts if p.segment == segments[1])
    kept = count_records(segment_file(data_dir, "c", segments[1]))
    assert sum(b.num_rows for b in reader.read(second)) == kept


def test_streaming_query_fails_on_data_loss_by_default(
    spark: SparkSession, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    segments = two_segments(data_dir)
    kept = count_records(segment_file(data_dir, "c", segments[1]))
    segment_file(data_dir, "c", segments[0]).unlink()

    def run(name: str, **extra: str) -> Any:
        r = (
            spark.readStream.format("keyop")
            .option("data_dir", str(data_dir))
            .option("channel", "c")
            .option("start_offset", "0")
        )
        for k, v in extra.items():
            r = r.option(k, v)
        query = (
            r.load()
            .writeStream.format("memory")
            .queryName(name)
            .option("checkpointLocation", str(tmp_path / name))
            .start()
        )
        try:
            query.processAllAvailable()
        finally:
            query.stop()

    with pytest.raises(Exception, match="DataLossError"):
        run("loss_strict")
    run("loss_lenient", failOnDataLoss="false")
    assert spark.sql("SELECT count(*) AS n FROM loss_lenient").first()["n"] == kept


# ---------------------------------------------------------------------------
# Offsets options (Kafka's names): startingOffsets, endingOffsets, maxOffsetsPerTrigger
# ---------------------------------------------------------------------------


def test_starting_and_ending_offsets_bound_a_batch_read(
    spark: SparkSession, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    two_segments(data_dir)

    def read(**extra: str) -> Any:
        r = spark.read.format("keyop").option("data_dir", str(data_dir)).option("channel", "c")
        for k, v in extra.items():
            r = r.option(k, v)
        return r.load()

    offsets = [r["offset"] for r in read().select("offset").orderBy("offset").collect()]
    assert len(offsets) == 610
    lo, hi = offsets[100], offsets[500]
    got = read(startingOffsets=json.dumps({"c": lo}), endingOffsets=json.dumps({"c": hi}))
    assert [r["offset"] for r in got.select("offset").orderBy("offset").collect()] == offsets[
        100:500
    ]
    # Plain values and Kafka's names; an offset inside a record moves to the next one.
    assert read(startingOffsets="earliest", endingOffsets=str(hi - 1)).count() == 500
    assert read(startingOffsets="latest").count() == 0
    with pytest.raises(Exception, match="must name exactly the channel read"):
        read(startingOffsets=json.dumps({"other": 0})).collect()
    with pytest.raises(Exception, match="give one of the options 'start_offset' and"):
        read(startingOffsets="earliest", start_offset="0").collect()
    with pytest.raises(Exception, match="'maxOffsetsPerTrigger' applies to streaming reads"):
        read(maxOffsetsPerTrigger="1000").collect()


def test_max_offsets_per_trigger_splits_micro_batches(
    spark: SparkSession, tmp_path: Path
) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes

    data_dir = tmp_path / "data"
    two_segments(data_dir)
    end = ks.stream_end(str(data_dir), "c")
    reader = stream_reader(spark, data_dir, maxOffsetsPerTrigger="300000")
    assert reader.getDefaultReadLimit() == ReadMaxBytes(300000)
    cut = reader.latestOffset({"offset": 0}, ReadMaxBytes(300000))["offset"]
    assert 300000 <= cut < 300000 + 2400 and cut == ks.align_offset(str(data_dir), "c", cut)
    assert reader.latestOffset({"offset": 0}, ReadAllAvailable()) == {"offset": end}

    query = (
        spark.readStream.format("keyop")
        .option("data_dir", str(data_dir))
        .option("channel", "c")
        .option("maxOffsetsPerTrigger", "300000")
        .load()
        .writeStream.format("memory")
        .queryName("limited")
        .option("checkpointLocation", str(tmp_path / "limited"))
        .start()
    )
    try:
        query.processAllAvailable()
        batches = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    finally:
        query.stop()
    assert sum(batches) == 610 and len(batches) >= 4, batches
    assert spark.sql("SELECT count(DISTINCT id) AS n FROM limited").first()["n"] == 610


def test_engine_gap_inside_a_read_raises_unless_fail_on_data_loss_false(
    spark: SparkSession, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    segments = two_segments(data_dir, n=1000)
    assert len(segments) >= 3, segments
    reader = stream_reader(spark, data_dir)
    lenient = stream_reader(spark, data_dir, failOnDataLoss="false")
    start = reader.initialOffset()
    parts = reader.partitions(start, reader.latestOffset(start))
    second = next(p for p in parts if p.segment == segments[1])
    for seg in segments[:2]:
        segment_file(data_dir, "c", seg).unlink()
    # The engine's reader (below the planning checks) finds the gap itself.
    with pytest.raises(DataLossError):
        list(reader.spec.read(second))
    assert list(lenient.spec.read(second)) == []


# ---------------------------------------------------------------------------
# Several channels, timestamps, maxBytesPerTrigger, AvailableNow, lag
# ---------------------------------------------------------------------------


def small_channels(data_dir: Path, sizes: dict[str, int]) -> None:
    m = km.Messenger(km.Config.from_dict({"name": "opts", "storage": {"data_dir": str(data_dir)}}))
    try:
        for channel, n in sizes.items():
            m.publish_batch(channel, [("t", {"i": i, "ch": channel}) for i in range(n)])
    finally:
        m.close()


def reader_of(spark: SparkSession, data_dir: Path, channel: str, **extra: str) -> Any:
    r = spark.read.format("keyop").option("data_dir", str(data_dir)).option("channel", channel)
    for k, v in extra.items():
        r = r.option(k, v)
    return r.load()


def test_several_channels_in_one_read(spark: SparkSession, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    small_channels(data_dir, {"a": 30, "b": 20, "x": 5})
    rows = reader_of(spark, data_dir, "a, b").select("channel", "payload").collect()
    got = sorted((r["channel"], json.loads(r["payload"])["i"]) for r in rows)
    assert got == sorted([("a", i) for i in range(30)] + [("b", i) for i in range(20)])
    # Per-channel offsets name every channel read.
    a_offsets = sorted(r["offset"] for r in reader_of(spark, data_dir, "a").collect())
    starts = json.dumps({"a": a_offsets[10], "b": "latest"})
    part = reader_of(spark, data_dir, "a,b", startingOffsets=starts).collect()
    assert sorted(json.loads(r["payload"])["i"] for r in part) == list(range(10, 30))
    assert {r["channel"] for r in part} == {"a"}
    with pytest.raises(Exception, match="must name exactly the channels read"):
        reader_of(spark, data_dir, "a,b", startingOffsets=json.dumps({"a": 0})).collect()
    with pytest.raises(Exception, match="each once"):
        reader_of(spark, data_dir, "a,a").collect()
    with pytest.raises(Exception, match=r"ChannelNotFoundError|does not exist"):
        reader_of(spark, data_dir, "a,nope").collect()

    # Streaming: one offset per channel, each channel's records once.
    reader = stream_reader(spark, data_dir, channel="a,b")
    start = reader.initialOffset()
    assert set(start["offsets"]) == {"a", "b"}
    query = (
        spark.readStream.format("keyop")
        .option("data_dir", str(data_dir))
        .option("channel", "a,b")
        .load()
        .writeStream.format("memory")
        .queryName("two_channels")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start()
    )
    try:
        query.processAllAvailable()
        small_channels(data_dir, {"b": 4})
        query.processAllAvailable()
    finally:
        query.stop()
    counts = spark.sql(
        "SELECT channel, count(DISTINCT id) AS n FROM two_channels GROUP BY channel"
    ).collect()
    assert {r["channel"]: r["n"] for r in counts} == {"a": 30, "b": 24}


def test_starting_and_ending_timestamps(spark: SparkSession, tmp_path: Path) -> None:
    import time

    data_dir = tmp_path / "data"
    small_channels(data_dir, {"c": 12})
    time.sleep(0.05)
    small_channels(data_dir, {"c": 8})
    ts = sorted(r["ts"] for r in reader_of(spark, data_dir, "c").collect())
    # The first record of the second batch, in milliseconds (rounded down):
    # every first-batch record is at least 50 ms older.
    cut_ms = int(ts[12].timestamp() * 1000)
    assert reader_of(spark, data_dir, "c", startingTimestamp=str(cut_ms)).count() == 8
    assert reader_of(spark, data_dir, "c", endingTimestamp=str(cut_ms)).count() == 12
    assert reader_of(spark, data_dir, "c", startingTimestamp="0").count() == 20
    late = str(int(ts[-1].timestamp() * 1000) + 1000)
    assert reader_of(spark, data_dir, "c", startingTimestamp=late).count() == 0
    with pytest.raises(Exception, match="give one of the options 'startingTimestamp'"):
        reader_of(spark, data_dir, "c", startingTimestamp="0", startingOffsets="0").collect()
    with pytest.raises(Exception, match="'startingTimestamp' must be an integer"):
        reader_of(spark, data_dir, "c", startingTimestamp="yesterday").collect()
    # A stream starts at the timestamp too.
    reader = stream_reader(spark, data_dir, startingTimestamp=str(cut_ms))
    start = reader.initialOffset()
    parts = reader.partitions(start, reader.latestOffset(start))
    assert sum(b.num_rows for p in parts for b in reader.read(p)) == 8


def test_max_bytes_per_trigger_available_now_and_lag(spark: SparkSession, tmp_path: Path) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes

    data_dir = tmp_path / "data"
    two_segments(data_dir)
    end = ks.stream_end(str(data_dir), "c")
    reader = stream_reader(spark, data_dir, maxBytesPerTrigger="400000")
    assert reader.getDefaultReadLimit() == ReadMaxBytes(400000)
    both = stream_reader(
        spark, data_dir, maxBytesPerTrigger="400000", maxOffsetsPerTrigger="300000"
    )
    assert both.getDefaultReadLimit() == ReadMaxBytes(300000)  # offsets are bytes: the smaller

    # Lag: what the planned micro-batch leaves behind the committed end.
    cut = reader.latestOffset({"offset": 0}, ReadMaxBytes(400000))["offset"]
    assert 400000 <= cut < end
    assert reader.reportLatestOffset() == {"offset": end, "bytesBehindLatest": end - cut}
    reader.latestOffset({"offset": 0}, ReadAllAvailable())
    assert reader.reportLatestOffset()["bytesBehindLatest"] == 0

    # AvailableNow: the target is the end when the query starts; later data waits.
    reader.prepareForTriggerAvailableNow()
    small_channels(data_dir, {"c": 3})
    assert reader.latestOffset({"offset": 0}, ReadAllAvailable()) == {"offset": end}

    query = (
        spark.readStream.format("keyop")
        .option("data_dir", str(data_dir))
        .option("channel", "c")
        .option("maxBytesPerTrigger", "400000")
        .load()
        .writeStream.format("memory")
        .queryName("available_now")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(120), "an AvailableNow query ends by itself"
        progress = [p for p in query.recentProgress if p["numInputRows"]]
    finally:
        query.stop()
    assert sum(p["numInputRows"] for p in progress) == 613 and len(progress) >= 3
    raw = [p["sources"][0]["latestOffset"] for p in progress]
    latest = [x if isinstance(x, dict) else json.loads(x or "{}") for x in raw]
    behind = [x.get("bytesBehindLatest") for x in latest]
    assert behind[0] > 0 and behind[-1] == 0, latest
