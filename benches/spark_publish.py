"""Spark benchmark: rows/s published from Spark through a hub, and read back.

    python benches/spark_publish.py [--rows N] [--partitions P] [--master local[2]]
                                    [--batch-sizes 100,1000,5000]

Needs pyspark 4.x with pyarrow and Java 17+. Starts a hub (mutual TLS on
127.0.0.1, certificates made on the fly) in this process and a Spark session,
then times, on the same DataFrame of sensor readings (~110-byte payloads):

* ``noop``: ``df.write.format("noop")``, Spark's own cost of producing the rows;
* ``keyop via hub``: the data source with ``config``, one ephemeral client per
  partition, for each ``batch_size`` (rows per ``publish_batch`` = per frame
  and per hub commit, fdatasynced by the hub);
* ``publish_partitions``: the foreachPartition helper (rows go through
  pickled Rows instead of Arrow);
* ``keyop data_dir``: the data source writing a local directory (tasks take
  turns on the directory lock, so this runs as one partition);
* ``read``: ``spark.read.format("keyop")`` of the hub's channel, counted, and
  with ``payload_schema`` parsed and aggregated.

Prints one table. Figures depend on cores, the disk (every hub commit is an
fdatasync) and the JVM warm-up: run it on the machine you care about. A
benchmark, not a test: it asserts only that every row arrived.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

import keyop_messenger as km
from keyop_messenger import cli

SCHEMA = "sensor STRING, seq BIGINT, celsius DOUBLE, ok BOOLEAN, read_at TIMESTAMP"


def keygen(*argv: object) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main([str(a) for a in argv]) == 0, argv


def make_pki(d: Path) -> None:
    keygen("keygen", "ca", "--out-cert", d / "ca.crt", "--out-key", d / "ca.key")
    for name in ("bench-hub", "bench-spark"):
        keygen(
            "keygen", "instance", "--ca", d / "ca.crt", "--ca-key", d / "ca.key",
            "--name", name, "--san", "127.0.0.1",
            "--out-cert", d / f"{name}.crt", "--out-key", d / f"{name}.key",
        )  # fmt: skip


def tls(d: Path, name: str) -> dict[str, str]:
    return {"cert": f"{d}/{name}.crt", "key": f"{d}/{name}.key", "ca": f"{d}/ca.crt"}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--batch-sizes", default="100,1000,5000")
    ap.add_argument("--dir", default=None, help="where the hub's data goes (default: a temp dir)")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from keyop_messenger import spark as kspark

    with tempfile.TemporaryDirectory(prefix="keyop-spark-bench-", dir=args.dir) as tmp:
        d = Path(tmp)
        make_pki(d)
        hub_dir = d / "hub"
        hub = km.Messenger(
            km.Config.from_dict(
                {
                    "name": "bench-hub",
                    "storage": {"data_dir": str(hub_dir)},
                    "hub": {
                        "enabled": True,
                        "listen_addr": "127.0.0.1:0",
                        "allowed_peers": [{"name": "bench-spark"}],
                    },
                    "tls": tls(d, "bench-hub"),
                }
            )
        )
        addr = hub.hub_address
        assert addr is not None
        config = d / "spark.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "name": "bench-spark",
                    "storage": {"data_dir": str(d / "unused")},
                    "client": {"hubs": [{"addr": f"127.0.0.1:{addr[1]}"}]},
                    "tls": tls(d, "bench-spark"),
                }
            )
        )
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = (
            SparkSession.builder.master(args.master)
            .appName("keyop-spark-bench")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        kspark.register(spark)
        results: list[tuple[str, int, float]] = []
        try:
            df = (
                spark.range(0, args.rows, 1, args.partitions)
                .select(
                    F.concat(F.lit("t-"), (F.col("id") % 64).cast("string")).alias("sensor"),
                    F.col("id").alias("seq"),
                    (F.col("id") % 400 / 10.0).alias("celsius"),
                    (F.col("id") % 2 == 0).alias("ok"),
                    F.expr("TIMESTAMP'2026-03-31 00:00:00' + make_interval(0,0,0,0,0,0,id)").alias(
                        "read_at"
                    ),
                )
                .cache()
            )
            n = df.count()  # materialise the cache
            warm = df.limit(1000).coalesce(1)
            warm.write.format("keyop").mode("append").option("config", str(config)).option(
                "channel", "warmup"
            ).option("payload_type", "bench.Reading").save()

            results.append(
                (
                    "noop (Spark alone)",
                    n,
                    timed(lambda: df.write.format("noop").mode("overwrite").save()),
                )
            )
            total = 0
            for bs in batch_sizes:
                secs = timed(
                    lambda bs=bs: (
                        df.write.format("keyop")
                        .mode("append")
                        .option("config", str(config))
                        .option("channel", "bench")
                        .option("payload_type", "bench.Reading")
                        .option("batch_size", str(bs))
                        .save()
                    )
                )
                total += n
                results.append((f"keyop via hub, batch_size={bs}", n, secs))
            secs = timed(
                lambda: kspark.publish_partitions(
                    df, "bench", "bench.Reading", str(config), batch_size=1000
                )
            )
            total += n
            results.append(("publish_partitions, batch_size=1000", n, secs))
            secs = timed(
                lambda: (
                    df.coalesce(1)
                    .write.format("keyop")
                    .mode("append")
                    .option("data_dir", str(d / "local"))
                    .option("channel", "bench")
                    .option("payload_type", "bench.Reading")
                    .option("sync_interval_ms", "0")
                    .save()
                )
            )
            results.append(("keyop data_dir (1 partition)", n, secs))

            stored = km.read_channel(hub_dir, "bench")
            got = sum(1 for _ in stored)
            assert got == total, f"the hub stored {got} of {total} rows"

            reader = (
                spark.read.format("keyop")
                .option("data_dir", str(hub_dir))
                .option("channel", "bench")
            )
            secs = timed(lambda: reader.load().count())
            results.append(("read: count()", got, secs))
            parsed = reader.option("payload_schema", SCHEMA).load()
            secs = timed(
                lambda: parsed.groupBy("payload.sensor").agg(F.avg("payload.celsius")).collect()
            )
            results.append(("read: payload_schema + groupBy", got, secs))
        finally:
            spark.stop()
            hub.close()

    noop_rate = results[0][1] / results[0][2]
    print(f"\nSpark {args.master}, {args.partitions} partitions, {args.rows:,} rows per write\n")
    print(f"{'case':<38} {'rows':>10} {'seconds':>9} {'rows/s':>11} {'x noop':>8}")
    print("-" * 80)
    for name, rows, secs in results:
        rate = rows / secs
        print(f"{name:<38} {rows:>10,} {secs:>9.2f} {rate:>11,.0f} {rate / noop_rate:>8.2f}")


if __name__ == "__main__":
    main()
