"""Exactly-once Spark writes: a retried task leaves one copy of each row in a
local data directory; the counts the job reports are the rows committed. (Through
a hub: tests/test_spark.py::test_bad_payload_fails_the_partition_after_committed_chunks,
whose retried task sends its committed rows again with the same ids.)

One module-scoped ``local[2,2]`` SparkSession (``spark.task.maxFailures`` 2: a
failed task is retried once). The task of partition 0 fails on its first
attempt after it committed at least one chunk (the DataFrame's own Python
code raises, once it sees rows of partition 0 in the channel).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import keyop_messenger as km
from keyop_messenger import _core
from keyop_messenger.errors import InvalidNameError

try:
    from pyspark.cloudpickle import register_pickle_by_value
    from pyspark.sql import SparkSession

    from keyop_messenger import spark as ks

    SPARK_PROBLEM: str | None = None
    # Spark workers cannot import this test module: send its functions by value.
    register_pickle_by_value(sys.modules[__name__])
except ImportError as exc:  # pragma: no cover - CI installs pyspark
    SPARK_PROBLEM = f"pyspark 4.x and pyarrow are required: {exc}"

pytestmark = pytest.mark.filterwarnings(
    "ignore:PySpark does not yet fully support pandas:FutureWarning"
)

ROWS = 3000
BATCH = 500
FAIL_AT = 1200  # rows of partition 0 produced before its first attempt fails
WAIT_S = 60.0


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    if SPARK_PROBLEM is not None:
        pytest.fail(f"Spark tests cannot run: {SPARK_PROBLEM}", pytrace=False)
    active = SparkSession.getActiveSession()
    if active is not None:  # tests/test_spark.py's session-wide one: share it, leave it open
        if active.sparkContext.master != "local[2,2]":
            master = active.sparkContext.master
            pytest.fail(f"these tests need task retries: master local[2,2], not {master}")
        ks.register(active)
        # Small Arrow batches: the writer gets rows while the failing UDF waits.
        key = "spark.sql.execution.arrow.maxRecordsPerBatch"
        before = active.conf.get(key)
        active.conf.set(key, "100")
        try:
            yield active
        finally:
            active.conf.set(key, before)
        return
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    work = tmp_path_factory.mktemp("spark-exactly-once")
    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("keyop-messenger-exactly-once")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
        .config("spark.python.worker.reuse", "false")
        .config("spark.sql.warehouse.dir", str(work / "warehouse"))
        .config("spark.driver.extraJavaOptions", f"-Dderby.system.home={work}")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    ks.register(session)
    try:
        yield session
    finally:
        session.stop()


class FailOnce:
    """A UDF of ``n`` returning padding; on the first attempt of partition 0,
    at ``n == FAIL_AT``, it waits (bounded) until ``committed()`` sees at
    least one chunk of partition 0 stored, then raises."""

    def __init__(self, committed: Callable[[], int], always: bool = False) -> None:
        self.committed = committed
        self.always = always

    def __call__(self, n: int) -> str:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if n == FAIL_AT and ctx is not None and ctx.partitionId() == 0:
            if ctx.attemptNumber() == 0 or self.always:
                deadline = time.monotonic() + WAIT_S
                while self.committed() < BATCH and time.monotonic() < deadline:
                    time.sleep(0.1)
                raise RuntimeError("injected failure of the first attempt")
        return "x" * 1000


class DirCommitted:
    """Rows of partition 0 stored in a data directory's channel."""

    def __init__(self, data_dir: Path, channel: str) -> None:
        self.data_dir, self.channel = str(data_dir), channel

    def __call__(self) -> int:
        if not os.path.isdir(os.path.join(self.data_dir, "channels", self.channel)):
            return 0
        return sum(1 for r in _core.read_channel(self.data_dir, self.channel) if r[9]["part"] == 0)


def failing_frame(
    spark: SparkSession, committed: Callable[[], int], always: bool = False
) -> Any:
    """``ROWS`` rows in 2 partitions (columns n, part, pad), partition 0's
    first attempt (every attempt if ``always``) failing after a committed chunk."""
    from pyspark.sql.functions import udf

    df = spark.range(0, ROWS, 1, 2).selectExpr("id AS n", "spark_partition_id() AS part")
    # useArrow=False: a plain row-at-a-time UDF, said so (pyspark cannot infer it
    # from a callable object's hints and warns).
    fail = udf(FailOnce(committed, always), "string", useArrow=False)
    return df.withColumn("pad", fail("n"))


def check_ids(ids: list[str], job_rows: dict[int, int]) -> None:
    assert len(ids) == len(set(ids)), "a row was stored twice"
    jobs = {i.split(":")[0] for i in ids}
    assert len(jobs) == 1, jobs
    job = jobs.pop()
    assert set(ids) == {f"{job}:{p}:{i}" for p, n in job_rows.items() for i in range(n)}


def test_publish_batch_takes_caller_ids(tmp_path: Path) -> None:
    config = km.Config.from_dict({"name": "n", "storage": {"data_dir": str(tmp_path / "d")}})
    with km.Messenger(config) as m:
        assert m.publish_batch("c", [("t", {"a": 1}), ("t", {"a": 2})], ids=["j:0:0", "j:0:1"]) == [
            "j:0:0",
            "j:0:1",
        ]
        with pytest.raises(InvalidNameError, match="invalid id"):
            m.publish_batch("c", [("t", {})], ids=["no spaces"])
        with pytest.raises(InvalidNameError, match="one id per message"):
            m.publish_batch("c", [("t", {}), ("t", {})], ids=["x"])
    assert [r[2] for r in _core.read_channel(str(tmp_path / "d"), "c")] == ["j:0:0", "j:0:1"]


def test_retried_task_writes_each_row_once_to_data_dir(
    spark: SparkSession, tmp_path: Path
) -> None:
    data_dir, report = tmp_path / "data", tmp_path / "report.json"
    df = failing_frame(spark, DirCommitted(data_dir, "exact"))
    (
        df.write.format("keyop")
        .mode("append")
        .option("data_dir", str(data_dir))
        .option("channel", "exact")
        .option("payload_type", "t")
        .option("batch_size", str(BATCH))
        .option("report_path", str(report))
        .save()
    )
    records = list(_core.read_channel(str(data_dir), "exact"))
    assert len(records) == ROWS
    assert sorted(r[9]["n"] for r in records) == list(range(ROWS))
    per_part = {p: sum(1 for r in records if r[9]["part"] == p) for p in (0, 1)}
    check_ids([r[2] for r in records], per_part)
    counts = json.loads(report.read_text())
    assert counts["status"] == "committed" and counts["rows"] == ROWS
    first = next(p for p in counts["partitions"] if p["partition_id"] == 0)
    # The retry resumed after the chunks the first attempt committed.
    assert first["attempt"] == 1 and first["skipped"] >= BATCH
    assert first["rows"] == per_part[0]
    assert not (data_dir / "spark-progress" / counts["partitions"][0]["job"]).exists()


def test_aborted_job_reports_the_rows_it_committed(spark: SparkSession, tmp_path: Path) -> None:
    data_dir, report = tmp_path / "data", tmp_path / "report.json"
    df = failing_frame(spark, DirCommitted(data_dir, "aborted"), always=True)
    with pytest.raises(Exception, match="injected failure"):
        (
            df.write.format("keyop")
            .mode("append")
            .option("data_dir", str(data_dir))
            .option("channel", "aborted")
            .option("payload_type", "t")
            .option("batch_size", str(BATCH))
            .option("report_path", str(report))
            .save()
        )
    records = list(_core.read_channel(str(data_dir), "aborted"))
    part0 = sum(1 for r in records if r[9]["part"] == 0)
    assert part0 >= BATCH, "the failing partition committed chunks"
    counts = json.loads(report.read_text())
    assert counts["status"] == "aborted"
    # Every row in the channel is accounted for: finished tasks plus failed ones.
    assert counts["rows"] + counts["rows_committed_by_failed_partitions"] == len(records)
    assert counts["rows_committed_by_failed_partitions"] >= part0
    # Two attempts of partition 0, one copy of each row.
    assert len({r[2] for r in records}) == len(records)


def _progress(data_dir: Path, job: str) -> int | None:
    """Rows the progress hint of partition 0 of ``job`` counts (None: no file)."""
    path = data_dir / "spark-progress" / job / "0.json"
    return json.loads(path.read_text())["rows"] if path.exists() else None


@pytest.mark.parametrize("sync_interval_ms", [None, 0])
def test_data_dir_task_hints_only_rows_that_are_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync_interval_ms: int | None
) -> None:
    """By default a data_dir task fsyncs once, when its rows are all written
    (one flush), so its progress hint counts no row before then: a hint that
    outran the disk would make a retry after a power cut skip lost rows. With
    ``sync_interval_ms=0`` every chunk is fsynced and the hint follows each."""
    from pyspark.sql.types import LongType, StructField, StructType

    from keyop_messenger.spark import writer

    flushes: list[int] = []
    real_flush = km.Messenger.flush

    def flush(self: km.Messenger, timeout: float | None = None) -> None:
        flushes.append(1)
        real_flush(self, timeout)

    monkeypatch.setattr(km.Messenger, "flush", flush)
    data_dir = tmp_path / "d"
    options = {"channel": "c", "payload_type": "t", "data_dir": str(data_dir), "batch_size": "2"}
    if sync_interval_ms is not None:
        options["sync_interval_ms"] = str(sync_interval_ms)
    spec = writer.WriteSpec.from_options(
        options, StructType([StructField("n", LongType())]), streaming=False
    )
    seen: dict[int, int | None] = {}

    def rows(fail_at: int | None) -> Iterator[dict[str, Any]]:
        for n in range(10):
            if n == 8:  # chunks [0, 1] and [2, 3] are committed by now
                seen[n] = _progress(data_dir, "j1" if fail_at is None else "j2")
            if n == fail_at:
                raise RuntimeError("task failed")
            yield {"n": n}

    commit = writer.publish_payloads(spec, rows(None), "j1")
    assert commit.rows == 10
    assert seen[8] == (0 if sync_interval_ms is None else 4)
    assert _progress(data_dir, "j1") == 10
    assert len(flushes) == 1  # once, at the end

    # A failed task: what it committed is made durable on close, then hinted.
    with pytest.raises(writer.PartitionError, match="committing 8 rows"):
        writer.publish_payloads(spec, rows(9), "j2")
    assert _progress(data_dir, "j2") == 8
    ids = [r[2] for r in _core.read_channel(str(data_dir), "c")]
    assert ids == [f"j1:0:{i}" for i in range(10)] + [f"j2:0:{i}" for i in range(8)]


def _dir_spec(data_dir: Path, batch_size: int) -> Any:
    from pyspark.sql.types import LongType, StructField, StructType

    from keyop_messenger.spark import writer

    options = {
        "channel": "c",
        "payload_type": "t",
        "data_dir": str(data_dir),
        "batch_size": str(batch_size),
        "lock_timeout_s": "30",
    }
    return writer.WriteSpec.from_options(
        options, StructType([StructField("n", LongType())]), streaming=False
    )


def test_a_task_of_an_aborted_job_appends_nothing(tmp_path: Path) -> None:
    from keyop_messenger.spark import writer

    data_dir = tmp_path / "d"
    spec = _dir_spec(data_dir, 2)
    (data_dir / "spark-progress").mkdir(parents=True)
    (data_dir / "spark-progress" / "j1.aborted").touch()
    with pytest.raises(writer.PartitionError, match="j1 was aborted"):
        writer.publish_payloads(spec, ({"n": n} for n in range(10)), "j1")
    assert not (data_dir / "channels" / "c").exists()
    # Another job is not stopped by that mark.
    assert writer.publish_payloads(spec, ({"n": n} for n in range(3)), "j2").rows == 3


def test_an_aborted_jobs_count_waits_for_its_running_task(tmp_path: Path) -> None:
    """Spark aborts a job while its other tasks still run: the report stops
    them and counts every row they appended, none after."""
    import threading

    from keyop_messenger.spark import writer

    data_dir = tmp_path / "d"
    spec = _dir_spec(data_dir, 2)
    errors: list[BaseException] = []

    def rows() -> Iterator[dict[str, Any]]:
        for n in range(400):  # bounded: about 8 s if never stopped
            time.sleep(0.02)
            yield {"n": n}

    def task() -> None:
        try:
            writer.publish_payloads(spec, rows(), "j3")
        except BaseException as exc:  # the test inspects it
            errors.append(exc)

    running = threading.Thread(target=task)
    running.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the task has committed chunks
            if (data_dir / "channels" / "c").is_dir():
                if len(list(_core.read_channel(str(data_dir), "c"))) >= 4:
                    break
            time.sleep(0.05)
        counts = writer.report(spec, [], aborted=True, job="j3")
    finally:
        running.join(timeout=30)
    assert not running.is_alive()
    assert len(errors) == 1 and "j3 was aborted" in str(errors[0])
    stored = list(_core.read_channel(str(data_dir), "c"))
    assert len(stored) >= 4 and len(stored) < 400
    assert counts["rows_committed_by_failed_partitions"] == len(stored)
    # A batch job's mark stays, its progress goes.
    assert (data_dir / "spark-progress" / "j3.aborted").exists()
    assert not (data_dir / "spark-progress" / "j3").exists()


def test_an_aborted_job_whose_tasks_never_started_does_not_wait_for_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No task of the job has a progress file: none can be mid-append, so
    the count does not wait for the lock (held here by another messenger,
    as when the job failed because the directory was busy)."""
    from keyop_messenger.spark import writer

    data_dir = tmp_path / "d"
    spec = _dir_spec(data_dir, 2)

    def no_lock(self: Any) -> Any:
        raise AssertionError("waited for the directory's lock")

    config = km.Config.from_dict({"name": "n", "storage": {"data_dir": str(data_dir)}})
    with km.Messenger(config):
        monkeypatch.setattr(writer.WriteSpec, "target", no_lock)
        counts = writer.report(spec, [], aborted=True, job="j4")
    assert counts["rows_committed_by_failed_partitions"] == 0
    assert (data_dir / "spark-progress" / "j4.aborted").exists()


def test_a_replayed_micro_batch_writes_nothing_twice_to_a_data_dir(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The driver lost after the sink committed a micro-batch but before Spark
    logged the commit (its commit log entry deleted here): the restarted query
    replays the batch under the same job, and its tasks find their rows."""
    src, dst, checkpoint = tmp_path / "src", tmp_path / "dst", tmp_path / "checkpoint"
    with km.Messenger({"name": "src", "storage": {"data_dir": str(src)}}) as m:
        m.publish_batch("in", [("t", {"n": i}) for i in range(100)])

    def run() -> None:
        query = (
            spark.readStream.format("keyop").option("data_dir", str(src)).option("channel", "in")
            .load().select("payload")
            .writeStream.format("keyop").option("data_dir", str(dst)).option("channel", "out")
            .option("payload_type", "copy").option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True).start()
        )  # fmt: skip
        query.awaitTermination(WAIT_S)
        assert query.exception() is None, query.exception()

    def ids() -> list[str]:
        return [r[2] for r in _core.read_channel(str(dst), "out")]

    run()
    first = ids()
    assert len(first) == 100
    commits = checkpoint / "commits"
    last = max((p for p in commits.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    last.unlink()
    (commits / f".{last.name}.crc").unlink(missing_ok=True)
    run()
    assert ids() == first, "a replayed micro-batch wrote its rows again"
    # Only the last committed batch's progress is kept.
    progress = sorted(p.name for p in (dst / "spark-progress").iterdir() if p.is_dir())
    assert len(progress) == 1, progress
