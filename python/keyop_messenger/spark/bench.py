"""``keyop-messenger bench --spark``: the data source against Spark's own JSON
files, on the same rows in the same run.

Times, on one cached DataFrame of sensor readings (about 110-byte payloads,
two partitions):

* write: ``df.write.json`` against ``df.write.format("keyop")`` into a data
  directory (every chunk of ``batch_size`` rows written and fsynced);
* read: ``spark.read.schema(s).json`` against ``spark.read.format("keyop")``
  with ``payload_schema`` of the channel just written, both written to the
  ``noop`` sink so every column is produced;
* the ceilings of any Python data source on the machine: a Python Arrow
  writer that drops its batches, and a Python reader that yields ready-made
  Arrow batches of the same rows (what moving rows between the JVM and
  Python workers costs, before any work).

Each figure is the median of ``runs`` rounds after a warm-up, the cases
taking turns in every round; ratios are ``json seconds / keyop seconds``
(1.0: as fast as Spark's JSON files).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: The payload's columns (as in benches/spark_publish.py).
SCHEMA = "sensor STRING, seq BIGINT, celsius DOUBLE, ok BOOLEAN, read_at TIMESTAMP"


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _sources() -> tuple[type, type]:
    """Two Python data sources that do no work: ``keyop_bench_sink`` (an
    Arrow writer dropping its batches) and ``keyop_bench_source`` (a reader
    yielding ready-made Arrow batches of ``rows`` rows of :data:`SCHEMA`)."""
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceArrowWriter,
        DataSourceReader,
        InputPartition,
        WriterCommitMessage,
    )

    class _Sink(DataSourceArrowWriter):
        def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
            for _ in iterator:
                pass
            return WriterCommitMessage()

    class _Source(DataSourceReader):
        def __init__(self, rows: int, parts: int) -> None:
            self.rows, self.parts = rows, parts

        def partitions(self) -> list[InputPartition]:
            return [InputPartition(i) for i in range(self.parts)]

        def read(self, partition: InputPartition) -> Iterator[Any]:
            import pyarrow as pa  # type: ignore[import-untyped]
            import pyarrow.compute as pc  # type: ignore[import-untyped]

            n = self.rows // self.parts
            step = 8192
            for lo in range(0, n, step):
                ids = pa.array(range(lo, min(n, lo + step)), pa.int64())
                yield pa.RecordBatch.from_arrays(
                    [
                        pc.binary_join_element_wise(
                            "t-", pc.cast(pc.divide(ids, 64), pa.string()), ""
                        ),
                        ids,
                        pc.divide(pc.cast(ids, pa.float64()), 10.0),
                        pc.equal(pc.bit_wise_and(ids, 1), 0),
                        pc.cast(pc.multiply(ids, 1_000_000), pa.timestamp("us", tz="UTC")),
                    ],
                    names=["sensor", "seq", "celsius", "ok", "read_at"],
                )

    class Sink(DataSource):
        @classmethod
        def name(cls) -> str:
            return "keyop_bench_sink"

        def writer(self, schema: Any, overwrite: bool) -> _Sink:
            return _Sink()

    class Source(DataSource):
        @classmethod
        def name(cls) -> str:
            return "keyop_bench_source"

        def schema(self) -> str:
            return SCHEMA

        def reader(self, schema: Any) -> _Source:
            return _Source(int(self.options["rows"]), int(self.options["parts"]))

    return Sink, Source


#: The master of :func:`run` that starts a local standalone cluster first.
STANDALONE = "standalone"

#: How long the standalone cluster's master and workers may take to start.
CLUSTER_START_S = 120.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def standalone_cluster(workers: int = 2, cores: int = 1) -> Iterator[str]:
    """A Spark standalone cluster on 127.0.0.1 for the duration of the
    block: a master and ``workers`` workers of ``cores`` cores each, each a
    JVM started from pyspark's own jars (``spark-class``), their Python
    workers this interpreter. Yields the master URL; ends every process."""
    import pyspark

    home = Path(pyspark.__file__).parent
    spark_class = str(home / "bin" / "spark-class")
    env = dict(
        os.environ,
        SPARK_HOME=str(home),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        SPARK_NO_DAEMONIZE="1",
    )
    port, ui = _free_port(), _free_port()
    url = f"spark://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="keyop-spark-cluster-") as tmp:
        log = open(Path(tmp) / "cluster.log", "wb")  # closed in the finally below

        def start(*args: str) -> None:
            procs.append(subprocess.Popen(
                [spark_class, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                cwd=tmp, start_new_session=True,
            ))  # fmt: skip

        try:
            start("org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                  "--port", str(port), "--webui-port", str(ui))  # fmt: skip
            for i in range(workers):
                start("org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                      "--cores", str(cores), "--memory", "2g",
                      "--webui-port", str(_free_port()), "--work-dir", f"{tmp}/work{i}",
                      url)  # fmt: skip
            deadline = time.monotonic() + CLUSTER_START_S
            while True:
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(_cluster_failed(tmp, "a process of it exited"))
                if alive_workers(ui) == workers:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(_cluster_failed(tmp, f"not up in {CLUSTER_START_S:g} s"))
                time.sleep(0.5)
            yield url
        finally:
            # Each process leads its own group, with the executors a worker starts.
            for p in reversed(procs):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            for p in procs:
                _end_group(p.pid)
            log.close()


def alive_workers(ui_port: int) -> int:
    """Workers a standalone master's status page (on ``ui_port``) lists as alive;
    0 while the page is not up or not yet whole (a starting master can answer
    with an empty body)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as r:
            return int(json.load(r).get("aliveworkers", 0))
    except (OSError, ValueError):
        return 0


def _end_group(pgid: int, timeout_s: float = 30.0) -> None:
    """Waits until no live process is left in the process group ``pgid``
    (an executor may outlive its worker for a moment), killing what is left
    after ``timeout_s``."""

    def alive() -> bool:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # (state, ppid, pgrp, ...)
                return True
        return False

    for _ in range(2):  # after the caller's SIGTERM, then after a SIGKILL
        deadline = time.monotonic() + timeout_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _cluster_failed(tmp: str, why: str) -> str:
    text = (Path(tmp) / "cluster.log").read_text(errors="replace")
    return f"the Spark standalone cluster did not start ({why}):\n{text[-3000:]}"


def run(rows: int = 2_000_000, master: str = "local[2]", runs: int = 3) -> dict[str, Any]:
    """Runs the Spark figures on ``master`` (:data:`STANDALONE`: a local
    standalone cluster of two one-core workers, started and ended here);
    returns them by JSON key (seconds, rows/s and ratios)."""
    if master == STANDALONE:
        with standalone_cluster() as url:
            out = _run(rows, url, runs)
        out["spark_master"] = STANDALONE
        return out
    return _run(rows, master, runs)


def _run(rows: int, master: str, runs: int) -> dict[str, Any]:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from . import register

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(master)
        .appName("keyop-bench-spark")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    sink, source = _sources()
    spark.dataSource.register(sink)
    spark.dataSource.register(source)
    out: dict[str, Any] = {"spark_rows": rows, "spark_master": master}
    try:
        with tempfile.TemporaryDirectory(prefix="keyop-bench-spark-") as tmp:
            d = Path(tmp)
            df = (
                spark.range(0, rows, 1, 2)
                .select(
                    F.concat(F.lit("t-"), (F.col("id") % 64).cast("string")).alias("sensor"),
                    F.col("id").alias("seq"),
                    (F.col("id") % 400 / 10.0).alias("celsius"),
                    (F.col("id") % 2 == 0).alias("ok"),
                    F.expr(
                        "TIMESTAMP'2026-03-31 00:00:00' + make_interval(0,0,0,0,0,0,id)"
                    ).alias("read_at"),
                )
                .cache()
            )
            df.count()
            counter = iter(range(1_000_000))

            def write_json() -> None:
                df.write.mode("overwrite").json(str(d / "json"))

            def write_keyop() -> None:
                (
                    df.write.format("keyop").mode("append")
                    .option("data_dir", str(d / f"keyop{next(counter)}"))
                    .option("channel", "bench").option("payload_type", "bench.Reading")
                    .option("batch_size", "10000")
                    .save()
                )  # fmt: skip

            def write_floor() -> None:
                df.write.format("keyop_bench_sink").mode("append").save()

            def medians(*cases: Callable[[], object]) -> list[float]:
                """Median seconds of each case; the cases take turns in every
                round, so a machine whose load changes slows them alike."""
                for fn in cases:
                    fn()  # warm-up (and the data read below)
                rounds = [[_timed(fn) for fn in cases] for _ in range(runs)]
                return [statistics.median(r[i] for r in rounds) for i in range(len(cases))]

            w_json, w_keyop, w_floor = medians(write_json, write_keyop, write_floor)
            keyop_dir = str(d / "keyop0")

            def read_json() -> None:
                spark.read.schema(SCHEMA).json(str(d / "json")).write.format("noop").mode(
                    "overwrite"
                ).save()

            def read_keyop() -> None:
                (
                    spark.read.format("keyop").option("data_dir", keyop_dir)
                    .option("channel", "bench").option("payload_schema", SCHEMA).load()
                    .write.format("noop").mode("overwrite").save()
                )  # fmt: skip

            def read_floor() -> None:
                spark.read.format("keyop_bench_source").option("rows", str(rows)).option(
                    "parts", "2"
                ).load().write.format("noop").mode("overwrite").save()

            r_json, r_keyop, r_floor = medians(read_json, read_keyop, read_floor)
            got = spark.read.format("keyop").option("data_dir", keyop_dir).option(
                "channel", "bench"
            ).load().count()
            assert got == rows, f"the channel holds {got} of {rows} rows"
    finally:
        spark.stop()
    out.update(
        spark_write_json_s=w_json,
        spark_write_keyop_s=w_keyop,
        spark_write_python_floor_s=w_floor,
        spark_write_ratio=w_json / w_keyop,
        spark_write_ceiling_ratio=w_json / w_floor,
        spark_read_json_s=r_json,
        spark_read_keyop_s=r_keyop,
        spark_read_python_floor_s=r_floor,
        spark_read_ratio=r_json / r_keyop,
        spark_read_ceiling_ratio=r_json / r_floor,
        spark_write_rows_per_s=rows / w_keyop,
        spark_read_rows_per_s=rows / r_keyop,
    )
    return out


#: The masters ``keyop-messenger bench --spark`` measures by default.
DEFAULT_MASTERS = ("local[2]", STANDALONE)


def run_masters(rows: int, masters: list[str], runs: int) -> dict[str, Any]:
    """:func:`run` on each master in turn. The first master's figures keep
    their keys (``spark_write_ratio``, ...); a later one's are prefixed
    ``spark_standalone_`` (the local standalone cluster) or ``spark_cluster_``
    (any other master), ``spark_<label>_masters`` naming it."""
    out: dict[str, Any] = {}
    for i, master in enumerate(masters):
        figures = run(rows, master, runs)
        if i == 0:
            out.update(figures)
            continue
        label = "standalone" if master == STANDALONE else "cluster"
        out.update({f"spark_{label}_{k[len('spark_'):]}": v for k, v in figures.items()})
    return out


def rows_of(figures: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The table rows of :func:`run_masters`'s figures, one pair per master."""
    rows: list[tuple[str, str, str]] = []
    for prefix in ("spark_", "spark_standalone_", "spark_cluster_"):
        f = {k[len(prefix):]: v for k, v in figures.items() if k.startswith(prefix)}
        if "write_ratio" not in f:
            continue
        on = f" [{f['master']}]"
        rows += [
            ("spark write: keyop data_dir (rows/s)" + on, f"{f['write_rows_per_s']:,.0f}",
             f"{f['write_ratio']:.2f} x df.write.json "
             f"(ceiling {f['write_ceiling_ratio']:.2f}: a Python writer doing nothing)"),
            ("spark read: keyop payload_schema (rows/s)" + on, f"{f['read_rows_per_s']:,.0f}",
             f"{f['read_ratio']:.2f} x spark.read.json "
             f"(ceiling {f['read_ceiling_ratio']:.2f}: a Python reader doing nothing)"),
        ]  # fmt: skip
    return rows
