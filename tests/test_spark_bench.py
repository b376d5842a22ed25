"""``keyop-messenger bench --spark`` runs end to end (tiny, in a child process
with its own Spark sessions) on ``local[2]`` and on a local standalone cluster
it starts and ends, and reports both ratios and their ceilings for each as
JSON keys. A smoke test: the figures themselves belong to the bench."""

from __future__ import annotations

import json
import subprocess
import sys

KEYS = (
    "spark_write_ratio",
    "spark_read_ratio",
    "spark_write_ceiling_ratio",
    "spark_read_ceiling_ratio",
    "spark_write_json_s",
    "spark_write_keyop_s",
    "spark_read_json_s",
    "spark_read_keyop_s",
)


def test_bench_spark_reports_both_ratios_locally_and_on_a_standalone_cluster() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "keyop_messenger", "bench", "--spark", "--spark-rows", "3000",
         "--quick", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["spark_rows"] == figures["spark_standalone_rows"] == 3000
    assert (figures["spark_master"], figures["spark_standalone_master"]) == (
        "local[2]", "standalone"
    )
    for key in KEYS:
        assert figures[key] > 0, key
        assert figures[key.replace("spark_", "spark_standalone_", 1)] > 0, key
    # Every process of the cluster (master, workers, their executors) was ended
    # with the bench. (This process's own Spark driver, if an earlier test
    # started one, is org.apache.spark.deploy.SparkSubmit: not matched.)
    cluster = "org.apache.spark.deploy.master.Master|org.apache.spark.deploy.worker.Worker|" \
        "CoarseGrainedExecutorBackend"
    leftover = subprocess.run(["pgrep", "-af", cluster], capture_output=True, text=True)
    assert leftover.stdout == "", leftover.stdout
