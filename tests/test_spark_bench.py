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


def test_a_starting_masters_status_page_counts_no_workers() -> None:
    """While the cluster starts, the master's status page may be down, or up
    with an empty or partial body: each reads as no worker yet, so the start
    waits (bounded) instead of failing."""
    import http.server
    import socket
    import threading

    from keyop_messenger.spark.bench import alive_workers

    bodies = [b"", b"{\"aliveworkers\":", b"{}", b"{\"aliveworkers\": 2}"]

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies.pop(0)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert [alive_workers(port) for _ in range(4)] == [0, 0, 0, 2]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert alive_workers(closed) == 0
