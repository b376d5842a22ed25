"""keyop-messenger + PySpark: sensor readings -> hub -> read back -> aggregate per origin.

    python examples/spark_pipeline.py

Needs pyspark 4.x with pyarrow (``pip install 'keyop-messenger[spark]'``) and
Java 17+. Self-contained: everything lives in a temporary directory removed at
the end.

1. Makes a CA, a certificate for the hub and one per site (CN = instance name).
2. Starts a hub ("pipeline-hub", 127.0.0.1, a free port) in this process that
   allows the three sites to publish.
3. Starts a local[2] Spark session and registers the ``keyop`` data source.
4. Each site writes a DataFrame of sensor readings to channel ``readings``
   through the hub: every partition opens one ephemeral client and publishes
   its rows in ``publish_batch`` chunks; each row becomes one message whose
   origin is the site.
5. Reads the hub's channel back as a DataFrame (no lock is needed to read a
   data directory that a running messenger writes), parsing the payload with
   a schema, and aggregates per origin.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

import yaml

import keyop_messenger as km
from keyop_messenger import cli

SITES = ("site-north", "site-south", "site-west")
READING_SCHEMA = "sensor STRING, celsius DOUBLE, humidity DOUBLE, read_at TIMESTAMP"


def keygen(*argv: object) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        status = cli.main([str(a) for a in argv])
    if status != 0:
        raise SystemExit(f"keyop-messenger {' '.join(map(str, argv))} failed")


def make_pki(d: Path) -> None:
    print("1. certificates: a CA, the hub and one per site")
    keygen("keygen", "ca", "--out-cert", d / "ca.crt", "--out-key", d / "ca.key")
    for name in ("pipeline-hub", *SITES):
        keygen(
            "keygen", "instance", "--ca", d / "ca.crt", "--ca-key", d / "ca.key",
            "--name", name, "--san", "localhost", "--san", "127.0.0.1",
            "--out-cert", d / f"{name}.crt", "--out-key", d / f"{name}.key",
        )  # fmt: skip


def tls(d: Path, name: str) -> dict[str, str]:
    return {"cert": f"{d}/{name}.crt", "key": f"{d}/{name}.key", "ca": f"{d}/ca.crt"}


def site_config(d: Path, site: str, port: int) -> Path:
    """What a Spark job of ``site`` needs to publish through the hub."""
    path = d / f"{site}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": site,
                "storage": {"data_dir": str(d / site)},  # unused by an ephemeral client
                "client": {"hubs": [{"addr": f"127.0.0.1:{port}"}]},
                "tls": tls(d, site),
            }
        )
    )
    return path


def main() -> None:
    try:
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        from keyop_messenger import spark as kspark
    except ImportError as exc:
        raise SystemExit(f"this example needs pyspark 4.x and pyarrow: {exc}") from exc

    with tempfile.TemporaryDirectory(prefix="keyop-spark-") as tmp:
        d = Path(tmp)
        make_pki(d)
        hub_dir = d / "hub"
        hub = km.Messenger(
            km.Config.from_dict(
                {
                    "name": "pipeline-hub",
                    "storage": {"data_dir": str(hub_dir)},
                    "hub": {
                        "enabled": True,
                        "listen_addr": "127.0.0.1:0",
                        "allowed_peers": [{"name": s, "publish": ["readings"]} for s in SITES],
                    },
                    "tls": tls(d, "pipeline-hub"),
                }
            )
        )
        spark = None
        try:
            addr = hub.hub_address
            assert addr is not None
            print(f"2. hub 'pipeline-hub' listening on {addr[0]}:{addr[1]}")

            print("3. Spark session local[2]")
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            spark = (
                SparkSession.builder.master("local[2]")
                .appName("keyop-spark-pipeline")
                .config("spark.sql.shuffle.partitions", "2")
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.sql.session.timeZone", "UTC")
                .getOrCreate()
            )
            spark.sparkContext.setLogLevel("ERROR")
            kspark.register(spark)

            for i, site in enumerate(SITES):
                readings = spark.range(0, 2000, 1, 4).select(
                    F.concat(F.lit(f"{site}-t"), (F.col("id") % 5).cast("string")).alias("sensor"),
                    F.round(15 + i * 4 + (F.col("id") % 50) / 10.0, 2).alias("celsius"),
                    F.round(40 + (F.col("id") % 30), 1).alias("humidity"),
                    F.expr("TIMESTAMP'2026-03-31 06:00:00' + make_interval(0,0,0,0,0,0,id)").alias(
                        "read_at"
                    ),
                )
                (
                    readings.write.format("keyop")
                    .mode("append")
                    .option("config", str(site_config(d, site, addr[1])))
                    .option("channel", "readings")
                    .option("payload_type", "demo.Reading")
                    .option("service_name", "spark-pipeline")
                    .save()
                )
                print(f"4. {site}: published {readings.count()} readings from 4 partitions")

            df = (
                spark.read.format("keyop")
                .option("data_dir", str(hub_dir))
                .option("channel", "readings")
                .option("payload_schema", READING_SCHEMA)
                .load()
            )
            print(f"5. read back {df.count()} messages from the hub's channel; per origin:")
            (
                df.groupBy("origin")
                .agg(
                    F.count("*").alias("readings"),
                    F.countDistinct("payload.sensor").alias("sensors"),
                    F.round(F.avg("payload.celsius"), 2).alias("avg_celsius"),
                    F.max("payload.celsius").alias("max_celsius"),
                    F.round(F.avg("payload.humidity"), 1).alias("avg_humidity"),
                    F.max("payload.read_at").alias("last_reading"),
                )
                .orderBy("origin")
                .show(truncate=False)
            )
        finally:
            if spark is not None:
                spark.stop()
            hub.close()
    print("done; temporary files removed")


if __name__ == "__main__":
    main()
