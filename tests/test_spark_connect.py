"""The ``keyop`` data source from a Spark Connect client.

The test starts a local Spark Connect server (the class ships in pyspark's own
jars: ``spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``)
bound to 127.0.0.1, and runs a client (``SparkSession.builder.remote``) in a
child process, apart from the classic sessions of the other Spark tests: it
registers the data source on the client (``spark.dataSource.register``), writes
rows into a data directory, and reads them back, batch and streaming. The data
source runs in the server's Python workers (this interpreter). Needs
``pyspark[connect]`` (grpcio, pandas, ...) and Java 17+; both server and client
are ended by the test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_S = 180.0

CLIENT = textwrap.dedent(
    """
    import json, sys
    from pyspark.sql import SparkSession
    from keyop_messenger import spark as ks

    url, data_dir, checkpoint = sys.argv[1:4]
    spark = SparkSession.builder.remote(url).getOrCreate()
    assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
    ks.register(spark)
    df = spark.createDataFrame([(i, f"s{i}") for i in range(25)], "n BIGINT, s STRING")
    (df.repartition(2).write.format("keyop").mode("append").option("data_dir", data_dir)
       .option("channel", "c").option("payload_type", "t").save())
    read = (spark.read.format("keyop").option("data_dir", data_dir).option("channel", "c")
            .option("payload_schema", "n BIGINT, s STRING").load())
    rows = sorted((r.payload.n, r.payload.s) for r in read.collect())
    query = (spark.readStream.format("keyop").option("data_dir", data_dir)
             .option("channel", "c").load()
             .writeStream.format("memory").queryName("connected")
             .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    query.awaitTermination(120)
    streamed = spark.sql("SELECT count(*) AS n FROM connected").collect()[0]["n"]
    print("RESULT " + json.dumps({"rows": rows, "streamed": streamed}))
    spark.stop()
    """
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    try:
        import grpc  # noqa: F401
        import pyspark
    except ImportError as exc:  # pragma: no cover - the test extra installs them
        pytest.fail(f"Spark Connect tests need pyspark[connect]: {exc}", pytrace=False)
    home = Path(pyspark.__file__).parent
    work = tmp_path_factory.mktemp("connect")
    port = free_port()
    env = dict(
        os.environ,
        SPARK_HOME=str(home),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
    )
    cmd = [
        str(home / "bin" / "spark-submit"), "--master", "local[2]",
        "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--name", "keyop-connect-test",
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", "spark.driver.bindAddress=127.0.0.1",
        "--conf", "spark.driver.host=127.0.0.1",
        "--conf", "spark.ui.enabled=false",
        "--conf", "spark.sql.session.timeZone=UTC",
        "--conf", f"spark.sql.warehouse.dir={work / 'warehouse'}",
        "--conf", f"spark.driver.extraJavaOptions=-Dderby.system.home={work}",
    ]  # fmt: skip
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work, start_new_session=True
    )
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    "the Spark Connect server exited:\n"
                    + (work / "server.log").read_text(errors="replace")[-3000:]
                )
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("the Spark Connect server did not start") from None
                time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_data_source_from_a_spark_connect_client(connect_server: int, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, f"sc://127.0.0.1:{connect_server}", str(data_dir),
         str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stdout[-2000:] + done.stderr[-4000:]
    got = json.loads(results[-1][len("RESULT ") :])
    assert got["rows"] == [[i, f"s{i}"] for i in range(25)]
    assert got["streamed"] == 25


RELATIVE = textwrap.dedent(
    """
    import sys
    from pyspark.sql import SparkSession
    from keyop_messenger import spark as ks

    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
    ks.register(spark)
    df = spark.createDataFrame([(1,)], "n BIGINT")
    for what, run in [
        ("write", lambda: df.write.format("keyop").mode("append").option("data_dir", "rel")
            .option("channel", "c").option("payload_type", "t").save()),
        ("read", lambda: spark.read.format("keyop").option("data_dir", "rel")
            .option("channel", "c").load().collect()),
    ]:
        try:
            run()
        except Exception as exc:
            print(what.upper() + " REFUSED " + " ".join(str(exc).split())[:2000])
        else:
            print(what.upper() + " ACCEPTED")
    spark.stop()
    """
)


def test_a_relative_data_dir_over_spark_connect_is_refused(
    connect_server: int, tmp_path: Path
) -> None:
    """It would resolve in the server's session folder, which Spark deletes
    with the session: a write there would report success and then vanish."""
    done = subprocess.run(
        [sys.executable, "-c", RELATIVE, f"sc://127.0.0.1:{connect_server}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    lines = {line.split(" ", 1)[0]: line for line in done.stdout.splitlines()}
    assert {"WRITE", "READ"} <= set(lines), done.stdout[-2000:] + done.stderr[-4000:]
    for what in ("WRITE", "READ"):
        assert "REFUSED" in lines[what] and "give an absolute path" in lines[what], lines[what]
    assert not (tmp_path / "rel").exists()
