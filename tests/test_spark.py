# why this file is long: 15 end-to-end tests sharing one session-scoped SparkSession and hub
# process, slow to start.
"""The PySpark integration (keyop_messenger.spark), end to end.

A session-scoped ``local[2,2]`` SparkSession (a failed task is retried once)
and a real hub running in another process (tests/spark_hub.py: it records
every message its subscriber receives in a JSON-lines file). pyspark, pyarrow
and Java 17+ are required: when one is
missing every test here FAILS with the reason (CI installs them), nothing is
skipped.

Covered: batch write through the hub (10,000 rows from 4 partitions arrive
exactly once, payload == row), batch read (envelope columns and types, one
partition per segment, payload_schema), the data_dir write path with every
JSON-mapped type and concurrent tasks taking turns on the directory lock,
streaming read while messages are published, stopped and restarted from its
checkpoint (every message exactly once overall), streaming write to the hub,
a failing partition raising on the driver, publish_partitions, and the pure
helpers (planning at record boundaries, torn tails, conversions).
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import io
import itertools
import json
import math
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import keyop_messenger as km
from keyop_messenger.cli import main as cli_main


def _spark_problem() -> str | None:
    """Why the Spark tests cannot run here, or None."""
    try:
        import pyarrow  # noqa: F401
        import pyspark
    except ImportError as exc:
        return (
            f"pyspark 4.x and pyarrow are required ({exc}); install them with "
            "pip install -e '.[test]' (or 'pyspark>=4.0,<5' 'pyarrow>=18')"
        )
    if not pyspark.__version__.startswith("4."):
        return f"pyspark 4.x is required, found {pyspark.__version__}"
    java_home = os.environ.get("JAVA_HOME")
    java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java")
    if not java or not os.path.exists(java):
        return "Java 17 or newer is required by pyspark 4 (no `java` on PATH / in JAVA_HOME)"
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not m or int(m.group(1)) < 17:
        return f"Java 17 or newer is required by pyspark 4, found: {out.strip()[:100]}"
    return None


SPARK_PROBLEM = _spark_problem()
if SPARK_PROBLEM is None:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from keyop_messenger import spark as ks


pytestmark = pytest.mark.filterwarnings(
    "ignore:PySpark does not yet fully support pandas:FutureWarning"
)


@pytest.fixture(autouse=True)
def _require_spark() -> None:
    if SPARK_PROBLEM is not None:
        pytest.fail(f"Spark tests cannot run: {SPARK_PROBLEM}", pytrace=False)


#: Bound on every wait for deliveries.
WAIT_S = 60.0
HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------
# Session: Spark, certificates, the hub process
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    if SPARK_PROBLEM is not None:
        pytest.fail(f"Spark tests cannot run: {SPARK_PROBLEM}", pytrace=False)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    work = tmp_path_factory.mktemp("spark")
    session = (
        SparkSession.builder.master("local[2,2]")  # a failed task is retried once
        .appName("keyop-messenger-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
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


def _cli(*argv: object) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli_main([str(a) for a in argv])
    assert status == 0, f"keyop-messenger {argv}: {err.getvalue()}"


@dataclass(frozen=True)
class Certs:
    ca: Path
    hub_cert: Path
    hub_key: Path
    writer_cert: Path
    writer_key: Path


WRITER = "spark-writer"


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("pki")
    _cli("keygen", "ca", "--out-cert", d / "ca.crt", "--out-key", d / "ca.key")
    for name, sans in (("hub1", ("localhost", "127.0.0.1")), (WRITER, ())):
        san_args = [a for s in sans for a in ("--san", s)]
        _cli(
            "keygen", "instance", "--ca", d / "ca.crt", "--ca-key", d / "ca.key",
            "--name", name, "--out-cert", d / f"{name}.crt", "--out-key", d / f"{name}.key",
            *san_args,
        )  # fmt: skip
    return Certs(
        d / "ca.crt", d / "hub1.crt", d / "hub1.key", d / f"{WRITER}.crt", d / f"{WRITER}.key"
    )


def writer_config(path: Path, certs: Certs, port: int, work: Path) -> Path:
    """A YAML configuration for Spark tasks publishing to the hub at ``port``."""
    import yaml

    doc = {
        "name": WRITER,
        # Not used by an ephemeral client, but a configuration needs one.
        "storage": {"data_dir": str(work / "unused-data-dir")},
        "client": {"hubs": [{"addr": f"127.0.0.1:{port}"}]},
        "tls": {"cert": str(certs.writer_cert), "key": str(certs.writer_key), "ca": str(certs.ca)},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


class Hub:
    """tests/spark_hub.py running in a child process."""

    CHANNELS = ("rows", "helper", "stream-out", "fail")

    def __init__(self, work: Path, certs: Certs) -> None:
        self.data_dir = work / "hub-data"
        self.out = work / "received.jsonl"
        self.out.touch()
        cmd = [
            sys.executable, str(HERE / "spark_hub.py"), "--data-dir", str(self.data_dir),
            "--cert", str(certs.hub_cert), "--key", str(certs.hub_key), "--ca", str(certs.ca),
            "--peer", WRITER, "--out", str(self.out), "--segment-mb", "1", "--hold",
        ]  # fmt: skip
        for c in self.CHANNELS:
            cmd += ["--channel", c]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("PORT "):
            self.stop()
            raise AssertionError(f"the hub did not start (said {line!r})")
        self.port = int(line.split()[1])
        self.config = writer_config(work / "writer.yaml", certs, self.port, work)

    def received(self, channel: str) -> list[dict[str, Any]]:
        text = self.out.read_text(encoding="utf-8")
        text = text[: text.rfind("\n") + 1]
        return [r for r in map(json.loads, text.splitlines()) if r["channel"] == channel]

    def wait_count(self, channel: str, n: int) -> list[dict[str, Any]]:
        """Waits until ``n`` messages of ``channel`` arrived, then until no
        more arrive for 1 s; returns them all."""
        deadline = time.monotonic() + WAIT_S
        while len(got := self.received(channel)) < n:
            assert self.proc.poll() is None, "the hub process died"
            if time.monotonic() > deadline:
                raise AssertionError(f"{channel}: {len(got)} of {n} messages arrived")
            time.sleep(0.1)
        time.sleep(1.0)
        return self.received(channel)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[Hub]:
    h = Hub(tmp_path_factory.mktemp("hub"), certs)
    try:
        yield h
    finally:
        h.stop()
        assert h.proc.returncode == 0, f"the hub exited with {h.proc.returncode}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_messenger(data_dir: Path, name: str = "local", segment_mb: int = 256) -> km.Messenger:
    return km.Messenger(
        km.Config.from_dict(
            {
                "name": name,
                "storage": {"data_dir": str(data_dir), "segment_size_mb": segment_mb},
            }
        )
    )


# ---------------------------------------------------------------------------
# Batch write through the hub, batch read back
# ---------------------------------------------------------------------------

ROWS_DDL = (
    "n BIGINT, sensor STRING, value DOUBLE, ok BOOLEAN, seq ARRAY<BIGINT>, "
    "inner STRUCT<x: BIGINT, label: STRING>"
)


def sensor_rows(spark: SparkSession, n: int, partitions: int) -> DataFrame:
    return spark.range(0, n, 1, partitions).selectExpr(
        "id AS n",
        "concat('sensor-', CAST(id % 7 AS STRING)) AS sensor",
        "CAST(id AS DOUBLE) * 0.25 AS value",
        "id % 2 = 0 AS ok",
        "array(id, id + 1) AS seq",
        "named_struct('x', id * 2, 'label', IF(id % 3 = 0, NULL, 'é\"\\n')) AS inner",
    )


@dataclass
class Published:
    expected: dict[int, dict[str, Any]]
    received: list[dict[str, Any]]
    report: dict[str, Any]


@pytest.fixture(scope="session")
def published(spark: SparkSession, hub: Hub, tmp_path_factory: pytest.TempPathFactory) -> Published:
    """10,000 rows from 4 partitions written to channel ``rows`` through the hub."""
    report = tmp_path_factory.mktemp("report") / "report.json"
    df = sensor_rows(spark, 10_000, 4)
    assert df.rdd.getNumPartitions() == 4
    (
        df.write.format("keyop")
        .mode("append")
        .option("config", str(hub.config))
        .option("channel", "rows")
        .option("payload_type", "spark.SensorRow")
        .option("service_name", "spark-tests")
        .option("batch_size", "700")
        .option("report_path", str(report))
        .save()
    )
    expected = {r["n"]: r.asDict(recursive=True) for r in df.collect()}
    return Published(expected, hub.wait_count("rows", 10_000), json.loads(report.read_text()))


def test_write_through_hub_delivers_every_row_exactly_once(published: Published) -> None:
    got = published.received
    assert len(got) == 10_000
    assert len({m["id"] for m in got}) == 10_000
    by_n = {m["payload"]["n"]: m for m in got}
    assert len(by_n) == 10_000
    for n, row in published.expected.items():
        msg = by_n[n]
        assert msg["payload"] == row
        assert list(msg["payload"]) == list(row)  # column order kept
    assert {m["origin"] for m in got} == {WRITER}
    assert {m["payload_type"] for m in got} == {"spark.SensorRow"}
    assert {m["service_name"] for m in got} == {"spark-tests"}
    assert {m["correlation_id"] for m in got} == {None}
    # The commit messages: one per partition, with its count.
    report = published.report
    assert report["status"] == "committed" and report["rows"] == 10_000
    parts = sorted(report["partitions"], key=lambda p: p["partition_id"])
    assert [p["partition_id"] for p in parts] == [0, 1, 2, 3]
    assert [p["rows"] for p in parts] == [2500] * 4
    assert [p["batches"] for p in parts] == [4] * 4  # 700 + 700 + 700 + 400
    # No chunk had to be sent again: concurrent tasks share the writer's
    # certificate, and the hub keeps every ephemeral connection of a peer.
    assert [p["resent"] for p in parts] == [0] * 4
    ids = {m["id"] for m in got}
    assert all(p["first_id"] in ids and p["last_id"] in ids for p in parts)


ENVELOPE_TYPES = [
    ("id", "string"),
    ("ts", "timestamp"),
    ("channel", "string"),
    ("origin", "string"),
    ("payload_type", "string"),
    ("service_name", "string"),
    ("correlation_id", "string"),
    ("payload", "string"),
    ("segment", "bigint"),
    ("offset", "bigint"),
]


def test_batch_read_returns_what_was_published(
    spark: SparkSession, hub: Hub, published: Published
) -> None:
    data_dir = str(hub.data_dir)
    segments = ks.list_segments(data_dir, "rows")
    assert len(segments) >= 2, "the hub should have rolled segments (segment_size_mb=1)"
    df = spark.read.format("keyop").option("data_dir", data_dir).option("channel", "rows").load()
    assert df.dtypes == ENVELOPE_TYPES
    planned = ks.plan_partitions(data_dir, "rows", 0, ks.stream_end(data_dir, "rows"))
    assert df.rdd.getNumPartitions() == len(segments), (planned, segments)
    rows = df.collect()
    assert len(rows) == 10_000
    received = {m["id"]: m for m in published.received}
    stored = {e.message.id: e for e in km.read_channel(data_dir, "rows")}
    assert {r.id for r in rows} == set(received) == set(stored)
    for r in rows:
        msg, entry = received[r.id], stored[r.id]
        assert json.loads(r.payload) == msg["payload"]
        assert (r.channel, r.origin, r.payload_type) == ("rows", WRITER, "spark.SensorRow")
        assert (r.service_name, r.correlation_id) == ("spark-tests", None)
        assert (r.offset, r.segment) == (entry.offset, entry.segment)
        assert isinstance(r.ts, datetime.datetime)
        # Collected timestamps are naive local time; the stored one is UTC.
        assert r.ts.astimezone(datetime.timezone.utc) == entry.message.timestamp
    assert {r.segment for r in rows} == set(segments)


def test_read_with_payload_schema_and_split_partitions(
    spark: SparkSession, hub: Hub, published: Published
) -> None:
    df = (
        spark.read.format("keyop")
        .option("data_dir", str(hub.data_dir))
        .option("channel", "rows")
        .option("payload_schema", ROWS_DDL)
        .option("max_partition_bytes", str(400_000))
        .load()
    )
    assert df.schema["payload"].dataType == StructType.fromDDL(ROWS_DDL)
    segments = ks.list_segments(str(hub.data_dir), "rows")
    assert df.rdd.getNumPartitions() > len(segments)
    rows = df.select("payload.*").collect()
    assert len(rows) == 10_000
    got = {r["n"]: r.asDict(recursive=True) for r in rows}
    assert got == published.expected
    # Aggregation works on the parsed columns.
    agg = {
        r["sensor"]: r["c"]
        for r in df.groupBy("payload.sensor").count().withColumnRenamed("count", "c").collect()
    }
    assert sum(agg.values()) == 10_000 and len(agg) == 7


def test_read_options_are_checked(spark: SparkSession, tmp_path: Path) -> None:
    def reader() -> Any:  # DataFrameReader.option() mutates the reader
        return spark.read.format("keyop")

    with pytest.raises(Exception, match="option 'data_dir' is required"):
        reader().option("channel", "x").load().collect()
    with pytest.raises(Exception, match="invalid channel name"):
        reader().option("data_dir", str(tmp_path)).option("channel", "a/b").load().collect()
    with pytest.raises(Exception, match="option 'start_offset' must be"):
        reader().option("data_dir", str(tmp_path)).option("channel", "x").option(
            "start_offset", "soon"
        ).load().collect()
    with pytest.raises(Exception, match="the schema must be the envelope's columns"):
        reader().schema("a INT").option("data_dir", str(tmp_path)).option(
            "channel", "x"
        ).load().collect()
    with pytest.raises(Exception, match="'retain_as' applies to streaming reads"):
        reader().option("data_dir", str(tmp_path)).option("channel", "x").option(
            "retain_as", "me"
        ).load().collect()
    # A channel that does not exist reads as empty with allowMissing (else an
    # error: tests/test_spark_paths.py).
    empty = (
        reader()
        .option("data_dir", str(tmp_path))
        .option("channel", "none")
        .option("allowMissing", "true")
        .load()
    )
    assert empty.count() == 0


# ---------------------------------------------------------------------------
# The data_dir write path and type mapping
# ---------------------------------------------------------------------------

TYPES_SQL = """
SELECT * FROM VALUES
  (1, 1.5D, 'plain', DATE'2024-02-29', TIMESTAMP'2024-02-29 12:34:56.789',
   TIMESTAMP_NTZ'2024-02-29 12:34:56', CAST('12345.678900' AS DECIMAL(20,6)), X'00FF10',
   array(named_struct('k', 'a', 'v', 1)), map('x', 1, 'y', 2), map(1, 'one'), 'corr-a'),
  (2, CAST('NaN' AS DOUBLE), 'é\\n"q"', DATE'1970-01-01', TIMESTAMP'1969-12-31 23:59:59.000001',
   TIMESTAMP_NTZ'2000-01-01 00:00:00.5', CAST('-0.000001' AS DECIMAL(20,6)), X'',
   array(), map(), map(2, 'two'), 'corr-a'),
  (3, CAST('Infinity' AS DOUBLE), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
   'corr-b')
AS t(n, d, s, day, ts, ntz, dec, bin, arr, m1, m2, corr)
"""


def test_data_dir_write_maps_types_and_round_trips(spark: SparkSession, tmp_path: Path) -> None:
    base = spark.sql(TYPES_SQL)
    # 3 copies of the rows in 3 partitions: concurrent tasks take turns on the lock.
    df = base.unionByName(base).unionByName(base).repartition(3).sortWithinPartitions("n")
    data_dir = tmp_path / "data"
    (
        df.write.format("keyop")
        .mode("append")
        .option("data_dir", str(data_dir))
        .option("name", "spark-local")
        .option("channel", "typed")
        .option("payload_type", "spark.Typed")
        .option("correlation_id_column", "corr")
        .option("batch_size", "2")
        .save()
    )
    entries = list(km.read_channel(data_dir, "typed"))
    assert len(entries) == 9
    assert {e.message.origin for e in entries} == {"spark-local"}
    assert {e.message.payload_type for e in entries} == {"spark.Typed"}
    for e in entries:
        assert e.message.correlation_id == e.message.payload["corr"]
    first = next(e.message.payload for e in entries if e.message.payload["n"] == 1)
    assert first == {
        "n": 1,
        "d": 1.5,
        "s": "plain",
        "day": "2024-02-29",
        "ts": "2024-02-29T12:34:56.789Z",
        "ntz": "2024-02-29T12:34:56",
        "dec": "12345.678900",
        "bin": "AP8Q",
        "arr": [{"k": "a", "v": 1}],
        "m1": {"x": 1, "y": 2},
        "m2": {"1": "one"},
        "corr": "corr-a",
    }
    second = next(e.message.payload for e in entries if e.message.payload["n"] == 2)
    assert second["d"] == "NaN" and second["s"] == 'é\n"q"'
    assert second["ts"] == "1969-12-31T23:59:59.000001Z"
    assert second["ntz"] == "2000-01-01T00:00:00.5"
    assert (second["dec"], second["bin"], second["arr"], second["m1"]) == ("-0.000001", "", [], {})
    third = next(e.message.payload for e in entries if e.message.payload["n"] == 3)
    assert third["d"] == "Infinity" and third["s"] is None and third["m2"] is None

    # Reading back with the DataFrame's own schema restores every value.
    back = (
        spark.read.format("keyop")
        .option("data_dir", str(data_dir))
        .option("channel", "typed")
        .option("payload_schema", base.schema.toDDL())
        .load()
        .select("payload.*")
    )
    want = sorted((r.asDict(recursive=True) for r in base.collect()), key=lambda r: r["n"])
    got = sorted((r.asDict(recursive=True) for r in back.collect()), key=lambda r: r["n"])
    assert len(got) == 9
    for i, row in enumerate(got):
        expect = dict(want[i // 3])
        if expect["n"] == 2:
            assert math.isnan(row.pop("d")) and math.isnan(expect.pop("d"))
        assert row == expect


def test_write_options_are_checked(spark: SparkSession, tmp_path: Path, hub: Hub) -> None:
    df = spark.range(3)

    def w(mode: str = "append") -> Any:  # DataFrameWriter.option() mutates the writer
        return df.write.format("keyop").mode(mode).option("payload_type", "t")

    with pytest.raises(Exception, match="exactly one of the options 'config'"):
        w().option("channel", "c").save()
    with pytest.raises(Exception, match="exactly one of the options 'config'"):
        w().option("channel", "c").option("data_dir", "x").option("config", "y").save()
    with pytest.raises(Exception, match="invalid channel name"):
        w().option("channel", "bad/name").option("data_dir", str(tmp_path)).save()
    with pytest.raises(Exception, match="append-only"):
        w("overwrite").option("channel", "c").option("data_dir", str(tmp_path)).save()
    with pytest.raises(Exception, match="correlation_id_column 'nope' is not a column"):
        w().option("channel", "c").option("data_dir", str(tmp_path)).option(
            "correlation_id_column", "nope"
        ).save()
    with pytest.raises(Exception, match="cannot read configuration file"):
        w().option("channel", "c").option("config", str(tmp_path / "missing.yaml")).save()
    assert not (tmp_path / "channels" / "c").exists() or not list(km.read_channel(tmp_path, "c"))


# ---------------------------------------------------------------------------
# Failures
# ---------------------------------------------------------------------------


def test_failing_partition_raises_on_driver(
    spark: SparkSession, certs: Certs, tmp_path: Path
) -> None:
    # Nobody listens on this port: every task fails to connect.
    config = writer_config(tmp_path / "down.yaml", certs, free_port(), tmp_path)
    report = tmp_path / "report.json"
    started = time.monotonic()
    with pytest.raises(Exception) as info:
        (
            spark.range(0, 100, 1, 2)
            .write.format("keyop")
            .mode("append")
            .option("config", str(config))
            .option("channel", "fail")
            .option("payload_type", "t")
            .option("connect_timeout_s", "2")
            .option("retries", "1")
            .option("report_path", str(report))
            .save()
        )
    text = str(info.value)
    pattern = r"keyop: partition \d \(attempt \d\) failed after committing 0 rows"
    assert re.search(pattern, text), text
    assert "ConnectionLostError" in text and "127.0.0.1" in text, text
    assert time.monotonic() - started < 60
    aborted = json.loads(report.read_text())
    assert aborted["status"] == "aborted" and aborted["rows"] == 0


def test_bad_payload_fails_the_partition_after_committed_chunks(
    spark: SparkSession, hub: Hub
) -> None:
    # A chunk over the 10 MiB record limit fails in the engine; the error
    # says how much of the partition was committed before.
    df = spark.range(0, 3, 1, 1).selectExpr(
        "id", "IF(id = 2, repeat('x', 11 * 1024 * 1024), 'small') AS text"
    )
    with pytest.raises(Exception) as info:
        (
            df.write.format("keyop")
            .mode("append")
            .option("config", str(hub.config))
            .option("channel", "fail")
            .option("payload_type", "t")
            .option("batch_size", "1")
            .save()
        )
    text = str(info.value)
    assert "failed after committing 2 rows in 2 batches" in text, text
    assert "MessageTooLargeError" in text, text
    got = hub.wait_count("fail", 2)
    assert [m["payload"] for m in got] == [{"id": 0, "text": "small"}, {"id": 1, "text": "small"}]


# ---------------------------------------------------------------------------
# publish_partitions
# ---------------------------------------------------------------------------


def test_publish_partitions_helper(spark: SparkSession, hub: Hub) -> None:
    df = sensor_rows(spark, 1000, 3)
    n = ks.publish_partitions(
        df, "helper", "spark.Helper", str(hub.config), batch_size=128, service_name="helper"
    )
    assert n == 1000
    got = hub.wait_count("helper", 1000)
    assert len(got) == 1000
    expected = {r["n"]: r.asDict(recursive=True) for r in df.collect()}
    assert {m["payload"]["n"]: m["payload"] for m in got} == expected
    assert {m["service_name"] for m in got} == {"helper"}
    with pytest.raises(km.InvalidNameError):
        ks.publish_partitions(df, "bad/name", "t", str(hub.config))


# ---------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------


class BatchCollector:
    """A foreachBatch sink that keeps, per batch id, the (id, segment) rows it
    saw; a replayed batch replaces (and must equal) the earlier attempt."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches: dict[int, list[tuple[str, int]]] = {}  # batch id -> (id, segment)
        self.replays: list[tuple[int, bool]] = []

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        rows = [(r.id, r.segment) for r in batch.select("id", "segment").collect()]
        with self.lock:
            if batch_id in self.batches:
                self.replays.append((batch_id, self.batches[batch_id] == rows))
            self.batches[batch_id] = rows

    def ids(self) -> list[str]:
        with self.lock:
            return [i for _, rows in sorted(self.batches.items()) for i, _ in rows]

    def segments(self) -> set[int]:
        with self.lock:
            return {s for rows in self.batches.values() for _, s in rows}


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_streaming_read_follows_a_growing_channel_across_restart(
    spark: SparkSession, tmp_path: Path
) -> None:
    data_dir, checkpoint = tmp_path / "data", tmp_path / "checkpoint"
    pad = "p" * 2200  # the first 500 records fill the first 1 MiB segment
    m = local_messenger(data_dir, segment_mb=1)
    published: list[str] = []
    stop_publishing = threading.Event()
    try:
        published += m.publish_batch("live", [("t", {"i": i, "pad": pad}) for i in range(500)])

        def publish_rest() -> None:
            # Until told to stop (so that both queries see new data arrive).
            deadline = time.monotonic() + 4 * WAIT_S
            while not stop_publishing.is_set() and time.monotonic() < deadline:
                first = len(published)
                items = [("t", {"i": first + i, "pad": pad}) for i in range(50)]
                published.extend(m.publish_batch("live", items))
                time.sleep(0.2)

        def start_query(sink: BatchCollector) -> Any:
            return (
                spark.readStream.format("keyop")
                .option("data_dir", str(data_dir))
                .option("channel", "live")
                .option("retain_as", "spark-live")
                .load()
                .writeStream.foreachBatch(sink)
                .option("checkpointLocation", str(checkpoint))
                .trigger(processingTime="300 milliseconds")
                .start()
            )

        sink = BatchCollector()
        query = start_query(sink)
        publisher = threading.Thread(target=publish_rest)
        publisher.start()
        try:
            wait_for("a first batch", lambda: len(sink.ids()) >= 500)
            # Spark commits a batch's end to the source when it plans the next.
            wait_for(
                "a committed batch",
                lambda: (read_offset_file(data_dir, "live", "spark-live") or 0) > 0,
            )
        finally:
            query.stop()
        # Retention while the query is down deletes only what it committed.
        retained = read_offset_file(data_dir, "live", "spark-live")
        assert retained is not None and retained > 0
        m.compact()
        assert ks.list_segments(str(data_dir), "live")[0] <= retained

        query = start_query(sink)
        try:
            at_restart = len(published)
            wait_for("batches after the restart", lambda: len(sink.ids()) > at_restart)
            stop_publishing.set()
            publisher.join(WAIT_S)
            assert not publisher.is_alive()
            query.processAllAvailable()
            progress = query.lastProgress
        finally:
            stop_publishing.set()
            query.stop()
    finally:
        m.close()

    ids = sink.ids()
    assert len(ids) == len(set(ids)), "a message was delivered twice"
    assert set(ids) == set(published), f"{len(set(published) - set(ids))} messages missing"
    assert all(same for _, same in sink.replays), "a replayed batch differed"
    assert len(sink.segments()) >= 2, "the channel should have rolled segments"
    end = progress["sources"][0]["endOffset"]
    end = json.loads(end) if isinstance(end, str) else end
    assert end == {"offset": ks.stream_end(str(data_dir), "live")}
    assert retained < read_offset_file(data_dir, "live", "spark-live") <= end["offset"]


def read_offset_file(data_dir: Path, channel: str, subscriber_id: str) -> int | None:
    path = data_dir / "subscribers" / channel / f"{subscriber_id}.offset"
    if not path.exists():
        return None
    text = path.read_text()
    assert text.endswith("\n") and text.strip().isdigit(), text
    return int(text)


def test_streaming_write_publishes_micro_batches_to_hub(
    spark: SparkSession, hub: Hub, tmp_path: Path
) -> None:
    data_dir = tmp_path / "source"
    with local_messenger(data_dir) as m:
        m.publish_batch("in", [("t", {"n": i, "label": f"l{i}"}) for i in range(300)])

    def run() -> None:
        query = (
            spark.readStream.format("keyop")
            .option("data_dir", str(data_dir))
            .option("channel", "in")
            .option("payload_schema", "n INT, label STRING")
            .load()
            .selectExpr("payload.n AS n", "payload.label AS label", "id AS source_id")
            .writeStream.format("keyop")
            .option("config", str(hub.config))
            .option("channel", "stream-out")
            .option("payload_type", "spark.Out")
            .option("batch_size", "100")
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(WAIT_S * 2)
        assert query.exception() is None, query.exception()

    run()
    got = hub.wait_count("stream-out", 300)
    source = {e.message.id: e.message.payload for e in km.read_channel(data_dir, "in")}
    assert len(got) == 300
    assert {m["payload"]["source_id"] for m in got} == set(source)
    for msg in got:
        p = msg["payload"]
        assert source[p["source_id"]] == {"n": p["n"], "label": p["label"]}
    corr = re.compile(r"^spark:[0-9a-f-]{36}:(\d+):(\d+):(\d+)$")
    keys = [corr.match(m["correlation_id"] or "") for m in got]
    assert all(keys), {m["correlation_id"] for m in got}
    # One key per chunk of at most 100 rows, contiguous on the channel.
    runs: list[str] = []
    for m in got:
        if not runs or runs[-1] != m["correlation_id"]:
            runs.append(m["correlation_id"])
    assert len(runs) == len(set(runs))

    # New input, same checkpoint: only the new messages are published.
    with local_messenger(data_dir) as m:
        m.publish_batch("in", [("t", {"n": i, "label": f"l{i}"}) for i in range(300, 350)])
    run()
    got = hub.wait_count("stream-out", 350)
    assert len(got) == 350
    assert sorted(m["payload"]["n"] for m in got) == list(range(350))


# ---------------------------------------------------------------------------
# Pure helpers (no Spark job)
# ---------------------------------------------------------------------------


def test_stream_end_counts_whole_lines_only(tmp_path: Path) -> None:
    with local_messenger(tmp_path) as m:
        m.publish_batch("c", [("t", {"i": i}) for i in range(10)])
        end = m.stream_end("c")
    assert ks.stream_end(str(tmp_path), "c") == end
    seg = tmp_path / "channels" / "c" / f"{0:020d}.jsonl"
    with open(seg, "ab") as f:
        f.write(b'{"v":1,"id":"torn')  # a record being written
    assert ks.stream_end(str(tmp_path), "c") == end
    assert ks.stream_end(str(tmp_path), "missing") == 0


def test_plan_partitions_cuts_at_record_boundaries(tmp_path: Path) -> None:
    with local_messenger(tmp_path, segment_mb=1) as m:
        for b in range(30):
            m.publish_batch("c", [("t", {"i": b * 100 + i, "pad": "z" * 300}) for i in range(100)])
        end = m.stream_end("c")
    entries = list(km.read_channel(tmp_path, "c"))
    boundaries = {e.offset for e in entries} | {end}
    segments = ks.list_segments(str(tmp_path), "c")
    assert len(segments) >= 2
    whole = ks.plan_partitions(str(tmp_path), "c", 0, end)
    assert [(p.start, p.segment) for p in whole] == [(s, s) for s in segments]
    for size in (1, 5000, 100_000):
        parts = ks.plan_partitions(str(tmp_path), "c", 0, end, size)
        assert parts[0].start == 0 and parts[-1].end == end
        for a, b in itertools.pairwise(parts):
            assert a.end == b.start
        assert all(p.start in boundaries and p.end in boundaries for p in parts)
        assert all(p.start < p.end for p in parts)
        assert [p.index for p in parts] == list(range(len(parts)))
    # A start in the middle (a record boundary) and an end before the stream end.
    mid = entries[len(entries) // 2].offset
    parts = ks.plan_partitions(str(tmp_path), "c", mid, entries[-5].offset, 10_000)
    assert parts[0].start == mid and parts[-1].end == entries[-5].offset
    assert ks.plan_partitions(str(tmp_path), "c", end, end) == []


def test_align_offset_moves_to_the_next_record(tmp_path: Path) -> None:
    with local_messenger(tmp_path, segment_mb=1) as m:
        for _ in range(4):
            m.publish_batch("c", [("t", {"i": i, "pad": "y" * 500}) for i in range(1000)])
        end = m.stream_end("c")
    offsets = [e.offset for e in km.read_channel(tmp_path, "c")]
    assert len(ks.list_segments(str(tmp_path), "c")) >= 2
    for i in (0, 1, 999, 1000, 2500, len(offsets) - 1):
        assert ks.align_offset(str(tmp_path), "c", offsets[i]) == offsets[i]
        if i + 1 < len(offsets):
            assert ks.align_offset(str(tmp_path), "c", offsets[i] + 1) == offsets[i + 1]
    assert ks.align_offset(str(tmp_path), "c", offsets[-1] + 1) == end
    assert ks.align_offset(str(tmp_path), "c", end + 10**6) == end


def test_json_conversions() -> None:
    from pyspark.sql.types import (
        DecimalType,
        DoubleType,
        IntegerType,
        TimestampNTZType,
        TimestampType,
    )

    utc = datetime.timezone.utc
    to_ts = ks._json_to_spark(TimestampType())
    assert to_ts("2026-03-31T14:22:01.1234567Z") == datetime.datetime(
        2026, 3, 31, 14, 22, 1, 123456, tzinfo=utc
    )
    assert to_ts("2026-03-31T16:22:01+02:00") == datetime.datetime(
        2026, 3, 31, 14, 22, 1, tzinfo=utc
    )
    assert to_ts("2026-03-31") == datetime.datetime(2026, 3, 31, tzinfo=utc)
    assert to_ts("yesterday") is None and to_ts(None) is None
    assert to_ts(0) == datetime.datetime(1970, 1, 1, tzinfo=utc)
    ntz = ks._json_to_spark(TimestampNTZType())
    assert ntz("2026-03-31T14:22:01.5") == datetime.datetime(2026, 3, 31, 14, 22, 1, 500000)
    to_int = ks._json_to_spark(IntegerType())
    assert [to_int(v) for v in (1, 2.0, "3", 2.5, True, 2**40, "x")] == [1, 2, 3] + [None] * 4
    to_dec = ks._json_to_spark(DecimalType(5, 2))
    assert to_dec("1.005") == decimal.Decimal("1.01") and to_dec(1000) is None
    to_double = ks._json_to_spark(DoubleType())
    assert math.isnan(to_double("NaN")) and to_double("-Infinity") == -math.inf
    assert to_double(3) == 3.0 and to_double({}) is None
    assert (
        ks.format_timestamp(datetime.datetime(2026, 1, 2, 3, 4, 5, 120000, tzinfo=utc))
        == "2026-01-02T03:04:05.12Z"
    )
    assert ks.nullable_ddl("a INT NOT NULL, `b NOT NULL` STRING") == "a INT, `b NOT NULL` STRING"
