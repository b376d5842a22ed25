# why this file is long: one suite (Suite and the probes, figures and report of `keyop-messenger
# bench`); tests/test_bench.py patches this module's os, threading and _run_pinned, so a split
# would move those seams.
"""The benchmark suite behind ``keyop-messenger bench``.

Every figure is the median of several runs and is printed next to a raw probe
measured in the same run (a write+fdatasync loop for durable figures, a
loopback TLS echo for federated ones), so results read as ratios to what the
machine can do. The throughput loops also measure the process's CPU time (user
+ system, every thread), reported as CPU microseconds per published and per
delivered message. ``--json`` prints one JSON object; ``--quick`` stays under
a minute. ``--one-core`` measures the main throughput figures again in child
processes pinned to one CPU and to two and compares them (target: one core
>= 0.5 x two cores). Pin the whole suite to one core to stand in for a small
board::

    taskset -c 0 keyop-messenger bench --quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

PAYLOAD = {"sensor": "t-17", "celsius": 21.5, "seq": 0, "ok": True}
TYPE = "bench.Reading"


class Sample(NamedTuple):
    """One timed run of a throughput figure."""

    per_s: float
    """Messages per second of wall time."""
    cpu_us: float
    """Process CPU time (user + system, every thread) per message, in microseconds."""


class _Stopwatch:
    """Wall time and the process's CPU time, started together."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def sample(self, messages: int) -> Sample:
        wall = time.perf_counter() - self.wall
        cpu = time.process_time() - self.cpu
        return Sample(messages / wall, cpu * 1e6 / max(messages, 1))


def _median(runs: int, measure: Callable[[], Sample]) -> Sample:
    """Field-wise median of ``runs`` runs of ``measure``."""
    samples = [measure() for _ in range(runs)]
    return Sample(*(statistics.median(field) for field in zip(*samples, strict=True)))


def group_commit_ceiling(
    fdatasync_per_s: float,
    handoff_us: float,
    threads: int,
    full_fdatasync_per_s: float | None = None,
) -> float:
    """The most messages/s that ``threads`` durable publishers can commit.

    The limit holds for any group commit that runs one fdatasync at a time
    (a file's fdatasyncs are serial on ext4), where each publisher has one
    message in flight and publishers come back from a commit one at a time,
    ``handoff_us`` apart (the GIL: each one sleeps until its commit and must
    take the GIL back). Either the threads split into two batches, one
    gathering while the other syncs (``threads / 2`` per fdatasync, each
    taking no less than ``1 / fdatasync_per_s``, a one-record fdatasync's
    time), or every thread joins each batch and the disk idles while they
    come back (``threads`` per fdatasync plus ``threads`` hand-offs, the
    fdatasync taking ``1 / full_fdatasync_per_s``: that of ``threads``
    records, more pages than one record's; ``fdatasync_per_s`` if not given).
    """
    sync_us = 1e6 / fdatasync_per_s
    full_sync_us = 1e6 / (full_fdatasync_per_s or fdatasync_per_s)
    two_batches = threads / 2 / sync_us
    one_batch = threads / (full_sync_us + threads * handoff_us)
    return max(two_batches, one_batch) * 1e6


def _rate(seconds: float, step: Callable[[], int]) -> Sample:
    """Runs ``step`` (returns messages done) for ``seconds``."""
    done = 0
    clock = _Stopwatch()
    deadline = clock.wall + seconds
    while time.perf_counter() < deadline:
        done += step()
    return clock.sample(done)


def _in_threads(
    seconds: float, threads: int, burst: int, call: Callable[..., object], *args: object
) -> Sample:
    """Calls ``call(*args)`` from ``threads`` threads at once for ``seconds``
    (the clock read once per ``burst`` calls); the calls per second of all."""
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def worker(i: int) -> None:
        n = 0
        while time.perf_counter() < stop:
            for _ in range(burst):
                call(*args)
            n += burst
        counts[i] = n

    clock = _Stopwatch()
    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return clock.sample(sum(counts))


class Suite:
    """Runs the measurements in a scratch directory."""

    def __init__(self, root: Path, seconds: float, runs: int) -> None:
        self.root = root
        self.seconds = seconds
        self.runs = runs
        self.results: dict[str, Any] = {}
        self.rows: list[tuple[str, str, str]] = []
        self._n = 0
        self._made: list[Path] = []

    def _dir(self, name: str) -> str:
        self._n += 1
        path = self.root / f"{name}-{self._n}"
        self._made.append(path)
        return str(path)

    def sweep(self) -> None:
        """Deletes the data directories made so far; call it with none of
        them open. Kept for the whole run, they would grow the page cache by
        gigabytes, and on a VM whose host takes freed guest memory back (free
        page reporting), a page cache growing into memory the guest has not
        touched lately pays a host fault per new page: the last write-heavy
        cases then cost up to half again as much CPU per message
        (docs/performance.md)."""
        while self._made:
            shutil.rmtree(self._made.pop(), ignore_errors=True)

    def median(self, measure: Callable[[], Sample]) -> Sample:
        """Field-wise median of ``runs`` runs of ``measure`` (which opens and
        closes its own messengers), sweeping after each."""

        def swept() -> Sample:
            try:
                return measure()
            finally:
                self.sweep()

        return _median(self.runs, swept)

    def messenger(self, sync_interval_ms: int, **extra: Any) -> Any:
        """A messenger for one case, in a fresh data directory, with ``sync_interval_ms``; ``extra``
        adds configuration sections."""
        import keyop_messenger as km

        return km.Messenger(self.config(sync_interval_ms, **extra))

    def config(self, sync_interval_ms: int, **extra: Any) -> Any:
        """The configuration of :meth:`messenger`."""
        import keyop_messenger as km

        doc: dict[str, Any] = {
            "name": "bench",
            "storage": {
                "data_dir": self._dir("local"),
                "sync_interval_ms": sync_interval_ms,
                "offset_flush_interval_ms": 100,
            },
        }
        doc.update(extra)
        return km.Config.from_dict(doc)

    def value(self, key: str, value: float, decimals: int = 1) -> None:
        """A figure in the JSON only."""
        self.results[key] = round(value, max(1, decimals))

    def record(
        self, key: str, value: float, label: str, ratio: str = "", decimals: int = 0
    ) -> None:
        """A figure in the JSON and a row of the table."""
        self.value(key, value, decimals)
        self.rows.append((label, f"{value:,.{decimals}f}", ratio))

    def note(self, key: str, label: str, text: str) -> None:
        """A row without a figure (a section skipped, and why)."""
        self.results[key] = text
        self.rows.append((label, "-", text))

    # -- local -----------------------------------------------------------

    def raw_fdatasync(self, records: int = 1) -> Sample:
        """Write+fdatasync of ``records`` 200-byte records at a time; counts
        fdatasyncs."""
        record = (b"x" * 199 + b"\n") * records
        path = self.root / f"raw-{records}.probe"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:

            def step() -> int:
                os.write(fd, record)
                os.fdatasync(fd)
                return 1

            return _rate(self.seconds, step)
        finally:
            os.close(fd)
            path.unlink()

    def raw_write(self) -> Sample:
        """The floor under relaxed publish: a Python loop of 200-byte writes."""
        record = b"x" * 199 + b"\n"
        path = self.root / "raw-write.probe"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:

            def burst() -> int:
                for _ in range(1000):
                    os.write(fd, record)
                return 1000

            return _rate(self.seconds, burst)
        finally:
            os.close(fd)
            path.unlink()

    def raw_json_write(self) -> Sample:
        """The least a Python publisher does per message: ``json.dumps`` of the
        bench payload and one write of it as a line (no id, time or envelope)."""
        import json

        dumps = json.dumps
        path = self.root / "raw-json-write.probe"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:

            def burst() -> int:
                for _ in range(1000):
                    os.write(fd, (dumps(PAYLOAD) + "\n").encode())
                return 1000

            return _rate(self.seconds, burst)
        finally:
            os.close(fd)
            path.unlink()

    def gil_loop(self, threads: int) -> Sample:
        """Loops per second of ``json.dumps`` of the bench payload from ``threads``
        threads at once: work that holds the GIL and does no I/O, like a relaxed
        publish. Several threads can only take turns, so the ratio of 16 threads to
        one is what CPython's GIL hand-offs leave to 16 relaxed publishers."""
        return _in_threads(self.seconds, threads, 100, json.dumps, PAYLOAD)

    def gil_loop_ratio(self, threads: int = 16) -> float:
        """Median over ``runs`` pairs of :meth:`gil_loop` with ``threads`` threads
        against one thread, each pair run back to back."""
        return statistics.median(
            self.gil_loop(threads).per_s / self.gil_loop(1).per_s for _ in range(self.runs)
        )

    def thread_handoff(
        self, threads: int = 16, hops: int = 20_000, cpu: int | None = None
    ) -> float:
        """Microseconds per hand-off in a ring of ``threads`` Python threads.
        Each thread sleeps with the GIL released until the one before it wakes
        it, then takes the GIL back. A durable publisher among many does the
        same once per message (it sleeps until its commit), so this is the
        interpreter's and the machine's share of every such message, whatever
        the engine does. With ``cpu``, the ring's threads run on that CPU
        alone (a wake-up is then a context switch, not a cross-CPU one)."""
        locks = [threading.Lock() for _ in range(threads)]
        for lock in locks:
            lock.acquire()
        done = [0]

        def member(i: int) -> None:
            mine, following = locks[i], locks[(i + 1) % threads]
            while True:
                mine.acquire()
                if done[0] >= hops:
                    following.release()
                    return
                done[0] += 1
                following.release()

        ring = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(threads)]
        mask = os.sched_getaffinity(0)
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # this thread: the ring's threads inherit it
        try:
            for t in ring:
                t.start()
        finally:
            os.sched_setaffinity(0, mask)
        started = time.perf_counter()
        locks[0].release()
        for t in ring:
            t.join(timeout=60)
            if t.is_alive():
                raise RuntimeError("thread hand-off probe did not finish in 60 s")
        return (time.perf_counter() - started) * 1e6 / hops

    def publish_threads(self, threads: int, sync_interval_ms: int = 0) -> Sample:
        """Publishes per second from ``threads`` threads publishing at once: durable,
        or relaxed with ``sync_interval_ms``."""
        # A relaxed publish takes microseconds: read the clock once per 100.
        burst = 1 if sync_interval_ms == 0 else 100
        with self.messenger(sync_interval_ms) as m:
            return _in_threads(self.seconds, threads, burst, m.publish, "bench", TYPE, PAYLOAD)

    def publish_main_thread(self) -> Sample:
        """Durable publishes per second from the main thread (which waits for
        the committer thread in slices, so Ctrl-C is honoured)."""
        with self.messenger(0) as m:
            publish = m.publish

            def burst() -> int:
                for _ in range(100):
                    publish("bench", TYPE, PAYLOAD)
                return 100

            return _rate(self.seconds, burst)

    def publish_pipelined(self, window: int = 256) -> Sample:
        """Durable publishes per second from one thread with ``wait=False``:
        ``window`` receipts in flight, each waited for."""
        with self.messenger(0) as m:
            publish = m.publish

            def burst() -> int:
                receipts = [publish("bench", TYPE, PAYLOAD, wait=False) for _ in range(window)]
                for r in receipts:
                    r.wait()
                return window

            return _rate(self.seconds, burst)

    def publish_asyncio(self, tasks: int) -> Sample:
        """Durable publishes per second from ``tasks`` asyncio tasks of one
        AsyncMessenger, each awaiting one publish at a time."""
        import asyncio

        from .aio import AsyncMessenger

        async def main() -> Sample:
            async with AsyncMessenger(self.config(0)) as am:
                await am.publish("bench", TYPE, PAYLOAD)
                stop = time.perf_counter() + self.seconds
                counts = [0] * tasks

                async def task(i: int) -> None:
                    while time.perf_counter() < stop:
                        await am.publish("bench", TYPE, PAYLOAD)
                        counts[i] += 1

                clock = _Stopwatch()
                await asyncio.gather(*(task(i) for i in range(tasks)))
                return clock.sample(sum(counts))

        return asyncio.run(main())

    def publish_batch(self, size: int) -> Sample:
        """Messages per second of durable ``publish_batch`` calls of ``size`` messages."""
        with self.messenger(0) as m:
            items = [(TYPE, PAYLOAD)] * size
            return _rate(self.seconds, lambda: len(m.publish_batch("bench", items)))

    def publish_relaxed(self) -> Sample:
        """Relaxed publishes per second (fdatasync every 200 ms) from one thread."""
        with self.messenger(200) as m:
            publish = m.publish

            def burst() -> int:
                # A plain loop of publishes; the clock is read once per 1000.
                for _ in range(1000):
                    publish("bench", TYPE, PAYLOAD)
                return 1000

            return _rate(self.seconds, burst)

    def subscribe_relaxed(self, n: int) -> Sample:
        """Delivery rate of ``n`` stored messages into a no-op handler."""
        with self.messenger(200) as m:
            items = [(TYPE, PAYLOAD)] * 1000
            for _ in range(n // 1000):
                m.publish_batch("bench", items)
            return _deliver_backlog(m, n)

    def local_latency(self, sync_interval_ms: int) -> tuple[float, float]:
        """Publish -> callback latency p50/p99 (us) of single messages, one at a time."""
        with self.messenger(sync_interval_ms) as m:
            arrived = threading.Event()
            sent_at = 0.0
            lat: list[float] = []

            def handler(_msg: Any) -> None:
                lat.append(time.perf_counter() - sent_at)
                arrived.set()

            m.subscribe("latency", "probe", handler)
            deadline = time.perf_counter() + self.seconds
            while time.perf_counter() < deadline:
                arrived.clear()
                sent_at = time.perf_counter()
                m.publish("latency", TYPE, PAYLOAD)
                if not arrived.wait(5):
                    raise RuntimeError("a latency probe was not delivered within 5 s")
            q = statistics.quantiles(lat, n=100)
            return q[49] * 1e6, q[98] * 1e6

    # -- federated -------------------------------------------------------

    def pki(self) -> Path:
        """Makes a CA and the certificates of the federated cases (hub and client); returns their
        folder."""
        from ._pki import write_ca, write_instance

        d = self.root / "pki"
        d.mkdir(exist_ok=True)
        write_ca(f"{d}/ca.crt", f"{d}/ca.key")
        for name in ("bench-hub", "bench-client"):
            write_instance(
                f"{d}/ca.crt", f"{d}/ca.key", name, sans=["127.0.0.1"],
                out_cert=f"{d}/{name}.crt", out_key=f"{d}/{name}.key",
            )
        return d

    def tls_echo(self, pki: Path) -> tuple[float, float]:
        """Round trips per second and p50 (us) of a 200-byte TLS echo on loopback."""
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(pki / "bench-hub.crt", pki / "bench-hub.key")
        client_ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def serve() -> None:
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                while data := tls.recv(4096):
                    tls.sendall(data)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        lat: list[float] = []
        with socket.create_connection(("127.0.0.1", port)) as raw, client_ctx.wrap_socket(
            raw, server_hostname="127.0.0.1"
        ) as tls:
            msg = b"x" * 200
            deadline = time.perf_counter() + self.seconds
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                tls.sendall(msg)
                got = 0
                while got < len(msg):
                    got += len(tls.recv(4096))
                lat.append(time.perf_counter() - t0)
        listener.close()
        t.join(timeout=5)
        return len(lat) / sum(lat), statistics.median(lat) * 1e6

    def gateway(self, pki: Path, n: int) -> dict[str, float]:
        """The HTTP gateway from one keep-alive HTTPS client: durable publish
        requests/s (one message each), messages/s in batches of 100, and the
        SSE delivery rate of a backlog of ``n`` messages (from ``earliest``)."""
        import hashlib
        import http.client

        token = "bench-token"
        m = self.messenger(
            0,
            name="bench-hub",
            tls={"ca": str(pki / "ca.crt"), "cert": str(pki / "bench-hub.crt"),
                 "key": str(pki / "bench-hub.key")},
            gateway={
                "enabled": True, "listen_addr": "127.0.0.1:0", "rate_limit_per_s": 0,
                "max_body_bytes": 64 * 1024 * 1024,
                "tokens": [{"name": "bench",
                            "hash": "sha256:" + hashlib.sha256(token.encode()).hexdigest(),
                            "publish": ["gw", "gw-backlog"], "subscribe": ["gw-backlog"]}],
            },
        )  # fmt: skip
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        try:
            port = m.gateway_address[1]
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=60)

            def post(channel: str, body: bytes) -> None:
                conn.request("POST", f"/v1/channels/{channel}/messages", body, headers)
                resp = conn.getresponse()
                text = resp.read()
                if resp.status != 201:
                    raise RuntimeError(f"gateway publish: {resp.status} {text!r}")

            one = json.dumps({"payload_type": TYPE, "payload": PAYLOAD}).encode()
            batch = json.dumps({"messages": [{"payload_type": TYPE, "payload": PAYLOAD}] * 100}
                               ).encode()

            def single() -> int:
                post("gw", one)
                return 1

            def hundred() -> int:
                post("gw", batch)
                return 100

            requests = _median(self.runs, lambda: _rate(self.seconds, single))
            batched = _median(self.runs, lambda: _rate(self.seconds, hundred))
            fill = json.dumps({"messages": [{"payload_type": TYPE, "payload": PAYLOAD}] * 1000}
                              ).encode()
            for _ in range(max(1, n // 1000)):
                post("gw-backlog", fill)
            backlog = max(1, n // 1000) * 1000
            conn.close()

            def sse() -> Sample:
                stream = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=60)
                clock = _Stopwatch()
                stream.request("GET", "/v1/channels/gw-backlog/messages?from=earliest",
                               headers={**headers, "Accept": "text/event-stream"})
                resp = stream.getresponse()
                got = 0
                while got < backlog:
                    line = resp.readline()
                    if not line:
                        raise RuntimeError(f"the event stream ended after {got} events")
                    if line.startswith(b"data: "):
                        got += 1
                stream.close()
                return clock.sample(got)

            delivery = _median(self.runs, sse)
        finally:
            m.close()
        return {
            "requests_per_s": requests.per_s,
            "batch_100_per_s": batched.per_s,
            "sse_per_s": delivery.per_s,
        }

    def federated(
        self, pki: Path, n: int, round_trips: bool = True
    ) -> tuple[Sample, tuple[float, float] | None]:
        """Relaxed client -> hub throughput (msg/s arriving at a hub
        subscriber; CPU of both ends, which share this process), and unless
        ``round_trips`` is false, ephemeral publish round trip p50/p99 (us)."""
        import keyop_messenger as km

        tls = {"ca": str(pki / "ca.crt")}
        hub = self.messenger(
            200,
            name="bench-hub",
            hub={
                "enabled": True,
                "listen_addr": "127.0.0.1:0",
                "allowed_peers": [{"name": "bench-client"}],
            },
            tls={**tls, "cert": str(pki / "bench-hub.crt"), "key": str(pki / "bench-hub.key")},
        )
        try:
            port = hub.hub_address[1]
            arrived = 0
            done = threading.Event()

            def on_hub(_msg: Any) -> None:
                nonlocal arrived
                arrived += 1
                if arrived == n:
                    done.set()

            hub.subscribe("fed", "count", on_hub)
            client_tls = {
                **tls,
                "cert": str(pki / "bench-client.crt"),
                "key": str(pki / "bench-client.key"),
            }
            client = self.messenger(
                200,
                name="bench-client",
                client={
                    "enabled": True,
                    "hubs": [{"addr": f"127.0.0.1:{port}", "publish": ["fed"]}],
                },
                tls=client_tls,
            )
            try:
                clock = _Stopwatch()
                items = [(TYPE, PAYLOAD)] * 1000
                for _ in range(n // 1000):
                    client.publish_batch("fed", items)
                if not done.wait(120):
                    raise RuntimeError(f"only {arrived} of {n} federated messages arrived")
                throughput = clock.sample(n)
            finally:
                client.close()
            if not round_trips:
                return throughput, None
            cfg = km.Config.from_dict(
                {
                    "name": "bench-client",
                    "storage": {"data_dir": self._dir("unused")},
                    "client": {"hubs": [{"addr": f"127.0.0.1:{port}"}]},
                    "tls": client_tls,
                }
            )
            lat: list[float] = []
            with km.EphemeralMessenger(cfg) as e:
                deadline = time.perf_counter() + self.seconds
                while time.perf_counter() < deadline:
                    t0 = time.perf_counter()
                    e.publish("rtt", TYPE, PAYLOAD)
                    lat.append(time.perf_counter() - t0)
            q = statistics.quantiles(lat, n=100)
            return throughput, (q[49] * 1e6, q[98] * 1e6)
        finally:
            hub.close()


def _deliver_backlog(m: Any, n: int) -> Sample:
    """Subscribes an id whose offset file says 0 (a new id would start at the
    end) and times the delivery of the ``n`` stored messages."""
    data_dir = Path(m.config.storage.data_dir)
    sub_dir = data_dir / "subscribers" / "bench"
    sub_dir.mkdir(parents=True, exist_ok=True)
    (sub_dir / "replay.offset").write_text("0\n")
    seen = 0
    done = threading.Event()

    def handler(_msg: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == n:
            done.set()

    clock = _Stopwatch()
    sub = m.subscribe("bench", "replay", handler)
    if not done.wait(120):
        raise RuntimeError(f"only {seen} of {n} messages delivered")
    delivered = clock.sample(n)
    sub.close()
    return delivered


#: The environment of the small-board profile (docs/performance.md): one
#: worker thread in the engine's federation runtime.
SMALL_PROFILE_ENV = {"KEYOP_MESSENGER_WORKER_THREADS": "1"}

#: The child process of :func:`rss_idle_mb`: prints its resident memory (kB)
#: once idle. argv: kind (bare, local, client, hub), pki dir, data dir, peers.
_RSS_PROBE = """
import re, sys, time
def rss():
    return int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read())[1])
kind, pki, data, peers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if kind == 'bare':
    print(rss(), flush=True); raise SystemExit
import keyop_messenger as km
doc = {'name': 'probe', 'storage': {'data_dir': data}}
tls = {'cert': pki + '/probe.crt', 'key': pki + '/probe.key', 'ca': pki + '/ca.crt'}
if kind.startswith('client'):
    doc.update(tls=tls, client={'enabled': True, 'hubs': [
        {'addr': '127.0.0.1:9', 'publish': ['a']}, {'addr': '127.0.0.1:9', 'publish': ['b']}]})
elif kind == 'hub':
    doc.update(tls=tls, hub={'enabled': True, 'listen_addr': '127.0.0.1:0',
        'allowed_peers': [{'name': f'peer{i}'} for i in range(peers)]})
m = km.Messenger(km.Config.from_dict(doc))
m.publish('a', 't', {})
if kind == 'hub':
    print(m.hub_address[1], flush=True)
    deadline = time.monotonic() + 30
    while len(getattr(m.federation_status().hub, 'peers', [])) < peers:
        if time.monotonic() > deadline:
            raise SystemExit('peers did not connect')
        time.sleep(0.05)
time.sleep(1.0)
print(rss(), flush=True)
sys.stdin.read()
m.close()
"""

#: The peers of the hub probe: ephemeral clients that connect and stay idle.
_PEERS = """
import sys, keyop_messenger as km
pki, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
clients = []
for i in range(n):
    cfg = km.Config.from_dict({'name': f'peer{i}', 'storage': {'data_dir': pki + '/unused'},
        'client': {'hubs': [{'addr': '127.0.0.1:' + port}]},
        'tls': {'cert': f'{pki}/peer{i}.crt', 'key': f'{pki}/peer{i}.key', 'ca': pki + '/ca.crt'}})
    clients.append(km.EphemeralMessenger(cfg).__enter__())
print('connected', flush=True)
sys.stdin.read()
for c in clients:
    c.close()
"""


def rss_idle_mb(root: Path, peers: int = 10) -> dict[str, float]:
    """Resident memory (MB) above a bare interpreter of idle messengers, each
    in its own child process: local only, a client with 2 hubs configured
    (none reachable, so it keeps redialling), the same client with the
    small-board profile's environment (``SMALL_PROFILE_ENV``), and a hub with ``peers``
    connected peers (ephemeral clients in another process); byte-code cached."""
    from . import _core

    pki = root / "rss-pki"
    pki.mkdir(exist_ok=True)
    ca, ca_key = pki / "ca.crt", pki / "ca.key"
    _core.keygen_ca(ca, ca_key)
    for name in ["probe", *(f"peer{i}" for i in range(peers))]:
        _core.keygen_instance(ca, ca_key, name, pki / f"{name}.crt", pki / f"{name}.key",
                              sans=["127.0.0.1"])

    # Byte-code cached, as after a wheel install (pip compiles it): compiling
    # the package's sources at every start (PYTHONDONTWRITEBYTECODE with a
    # source tree) costs about 1 MB more that is never given back.
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    base_env["PYTHONPYCACHEPREFIX"] = str(root / "rss-pycache")

    def start(script: str, *args: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True,
                                env={**base_env, **(env or {})})

    def probe(kind: str) -> int:
        child = start(_RSS_PROBE, kind, str(pki), str(root / f"rss-{kind}"), str(peers),
                      env=SMALL_PROFILE_ENV if kind.endswith("-small") else None)
        assert child.stdout is not None and child.stdin is not None
        peer_proc = None
        try:
            if kind == "hub":
                port = child.stdout.readline().strip()
                peer_proc = start(_PEERS, str(pki), port, str(peers))
                assert peer_proc.stdout is not None
                if peer_proc.stdout.readline().strip() != "connected":
                    raise RuntimeError("the hub's peers did not connect")
            line = child.stdout.readline().strip()
            if not line.isdigit():
                raise RuntimeError(f"the {kind} memory probe failed")
            return int(line)
        finally:
            for proc in (peer_proc, child):
                if proc is not None:
                    proc.communicate(timeout=60)

    probe("client")  # compiles the byte-code the probes then find cached
    bare = probe("bare")
    return {kind: (probe(kind) - bare) / 1024
            for kind in ("local", "client", "client-small", "hub")}


#: Throughput figures that ``--one-core`` measures again pinned to one CPU
#: and to two: key (in ``one_core_ratio_<key>`` etc.) -> label.
ONE_CORE_CASES: dict[str, str] = {
    "publish_relaxed": "relaxed publish",
    "publish_durable_16": "durable publish, 16 threads",
    "publish_batch_100_durable": "durable publish_batch(100)",
    "subscribe_relaxed": "subscribe -> no-op handler",
    "federated_relaxed": "federated client -> hub",
}
ONE_CORE_TARGET = 0.5


def _settings(quick: bool) -> tuple[float, int, int]:
    """Seconds per timed loop, runs per figure, messages per backlog."""
    return (0.5, 1, 50_000) if quick else (2.0, 3, 300_000)


def pinned_throughput(cpus: set[int], quick: bool) -> dict[str, Sample]:
    """The ``ONE_CORE_CASES`` figures of this process after pinning it to
    ``cpus``. Call it before any messenger exists: the engine's threads
    inherit the affinity of the thread that starts them."""
    os.sched_setaffinity(0, cpus)
    seconds, runs, n = _settings(quick)
    with tempfile.TemporaryDirectory(prefix="keyop-bench-", ignore_cleanup_errors=True) as d:
        suite = Suite(Path(d), seconds, runs)
        pki = suite.pki()
        measures: dict[str, Callable[[], Sample]] = {
            "publish_relaxed": suite.publish_relaxed,
            "publish_durable_16": partial(suite.publish_threads, 16),
            "publish_batch_100_durable": partial(suite.publish_batch, 100),
            "subscribe_relaxed": partial(suite.subscribe_relaxed, n),
            "federated_relaxed": lambda: suite.federated(pki, n, round_trips=False)[0],
        }
        assert measures.keys() == ONE_CORE_CASES.keys()
        return {key: suite.median(measure) for key, measure in measures.items()}


def _run_pinned(cpus: list[int], quick: bool) -> dict[str, Sample]:
    """``pinned_throughput`` in a child process (a fresh engine, so that every
    thread it starts is pinned)."""
    cmd = [sys.executable, "-m", "keyop_messenger.bench", "--pinned", ",".join(map(str, cpus))]
    if quick:
        cmd.append("--quick")
    # The child imports this same package, also when it runs from a source tree.
    package_parent = str(Path(__file__).resolve().parents[1])
    path = [package_parent, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the benchmark pinned to CPUs {cpus} failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.splitlines()[-1])
    return {key: Sample(*value) for key, value in figures.items()}


def one_core_comparison(suite: Suite, quick: bool) -> None:
    """Records each ``ONE_CORE_CASES`` figure on one CPU, on two, and their
    ratio against the target (one core >= 0.5 x two cores). Both sides run in
    pinned child processes, so "two cores" means two also on a bigger machine."""
    label = "one-core comparison"
    if not hasattr(os, "sched_getaffinity"):
        suite.note("one_core_skipped", label, "skipped: no CPU affinity on this platform")
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        suite.note("one_core_skipped", label,
                   f"skipped: needs >= 2 CPUs; this process may use {len(cpus)}")
        return
    two = _run_pinned(cpus[:2], quick)
    one = _run_pinned(cpus[:1], quick)
    suite.results["one_core_cpus"] = str(cpus[0])
    suite.results["two_core_cpus"] = f"{cpus[0]},{cpus[1]}"
    met = True
    for key, case in ONE_CORE_CASES.items():
        ratio = one[key].per_s / two[key].per_s
        met = met and ratio >= ONE_CORE_TARGET
        verdict = "met" if ratio >= ONE_CORE_TARGET else "MISSED"
        suite.value(f"two_core_{key}_per_s", two[key].per_s)
        suite.value(f"one_core_ratio_{key}", ratio, decimals=2)
        suite.record(f"one_core_{key}_per_s", one[key].per_s, f"1 core: {case}",
                     f"{ratio:.2f} x 2 cores ({two[key].per_s:,.0f}); "
                     f"target >= {ONE_CORE_TARGET}: {verdict}")
    suite.results["one_core_target_met"] = met


def run(
    quick: bool, one_core: bool = False
) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """Runs the suite (``quick``: one short run of each case; ``one_core``: add the one-core
    comparison); returns the results by JSON key and the table rows."""
    seconds, runs, n = _settings(quick)
    with tempfile.TemporaryDirectory(prefix="keyop-bench-", ignore_cleanup_errors=True) as d:
        suite = Suite(Path(d), seconds, runs)
        raw = suite.median(suite.raw_fdatasync)
        suite.record("raw_fdatasync_per_s", raw.per_s, "raw write+fdatasync (200 B)",
                     "1.00 x raw")
        # The disk's own limit for 16 publishers: a 16-record batch per
        # fdatasync, which costs more than a one-record one (more pages).
        raw16 = suite.median(partial(suite.raw_fdatasync, 16))
        suite.record("raw_fdatasync_16_records_per_s", raw16.per_s,
                     "raw write+fdatasync (16 x 200 B)",
                     f"{raw16.per_s / raw.per_s:.2f} x raw")
        handoff = statistics.median(suite.thread_handoff() for _ in range(runs))
        suite.record("thread_handoff_16_us", handoff,
                     "hand-off in a ring of 16 Python threads (us)",
                     "wake a thread sleeping without the GIL; it takes the GIL", decimals=1)
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > 1:
            one_cpu = statistics.median(
                suite.thread_handoff(cpu=cpus[0]) for _ in range(runs))
            suite.record("thread_handoff_16_one_cpu_us", one_cpu,
                         "the same ring on one CPU (us)", "a context switch per hand-off",
                         decimals=1)
            # The ceiling takes the cheaper hand-off, so it holds wherever
            # the scheduler puts the publishers.
            handoff = min(handoff, one_cpu)
        durable = {t: suite.median(partial(suite.publish_threads, t)) for t in (1, 4, 16, 64)}
        ceiling_16 = 16 * raw16.per_s / durable[1].per_s
        suite.value("publish_durable_16_disk_ceiling_ratio", ceiling_16, decimals=2)
        handoff_ceiling_16 = (group_commit_ceiling(raw.per_s, handoff, 16, raw16.per_s)
                              / durable[1].per_s)
        suite.value("publish_durable_16_handoff_ceiling_ratio", handoff_ceiling_16, decimals=2)
        for threads, rate in durable.items():
            ratio = (f"{rate.per_s / raw.per_s:.2f} x raw" if threads == 1
                     else f"{rate.per_s / durable[1].per_s:.1f} x 1 thread")
            if threads == 16:
                ratio += (f" (disk ceiling {ceiling_16:.1f} x: 16 records per raw "
                          f"16-record fdatasync; hand-off ceiling {handoff_ceiling_16:.1f} x: "
                          f"one fdatasync at a time, threads back {handoff:.1f} us apart); "
                          "target >= 10 x")
            suite.record(f"publish_durable_{threads}_per_s", rate.per_s,
                         f"durable publish, {threads} thread(s)", ratio)
        _publish_without_blocking(suite, durable[1])
        batch = {s: suite.median(partial(suite.publish_batch, s)) for s in (10, 100, 1000)}
        for size, rate in batch.items():
            suite.record(f"publish_batch_{size}_durable_per_s", rate.per_s,
                         f"durable publish_batch({size})", f"{rate.per_s / raw.per_s:.0f} x raw")
        raw_write = suite.median(suite.raw_write)
        suite.record("raw_write_per_s", raw_write.per_s, "raw write loop from Python (200 B)",
                     "the floor under relaxed publish")
        raw_json = suite.median(suite.raw_json_write)
        suite.record("raw_json_write_per_s", raw_json.per_s,
                     "json.dumps + write loop from Python",
                     "the least a Python publisher does per message")
        relaxed = suite.median(suite.publish_relaxed)
        suite.record("publish_relaxed_per_s", relaxed.per_s, "relaxed publish (sync 200 ms)",
                     f"{relaxed.per_s / raw_write.per_s:.2f} x raw write, "
                     f"{relaxed.per_s / raw_json.per_s:.1f} x json.dumps + write; "
                     "target >= 0.6 x raw write")
        relaxed16 = suite.median(partial(suite.publish_threads, 16, 200))
        gil16 = suite.gil_loop_ratio()
        suite.record("python_gil_loop_16_ratio", gil16,
                     "16 threads of a GIL-holding Python loop / 1 thread",
                     "json.dumps, no I/O: what GIL hand-offs leave to 16 threads", decimals=2)
        suite.record("publish_relaxed_16_per_s", relaxed16.per_s,
                     "relaxed publish, 16 threads",
                     f"{relaxed16.per_s / relaxed.per_s:.2f} x 1 thread (the GIL-holding "
                     f"loop: {gil16:.2f} x); target >= 1")
        sub = suite.median(lambda: suite.subscribe_relaxed(n))
        suite.record("subscribe_relaxed_per_s", sub.per_s, "subscribe -> no-op handler",
                     "offsets persisted every 100 ms; target >= 2,000,000")
        for mode, interval in (("relaxed", 200), ("durable", 0)):
            p50, p99 = suite.local_latency(interval)
            suite.sweep()
            suite.record(f"deliver_{mode}_p50_us", p50, f"publish -> callback p50, {mode} (us)")
            suite.record(f"deliver_{mode}_p99_us", p99, f"publish -> callback p99, {mode} (us)")
        pki = suite.pki()
        echo_rate, echo_p50 = suite.tls_echo(pki)
        suite.record("raw_tls_echo_per_s", echo_rate, "raw loopback TLS echo (200 B)",
                     f"p50 {echo_p50:.0f} us")
        fed, rtt = suite.federated(pki, n)
        suite.sweep()
        assert rtt is not None
        p50, p99 = rtt
        # Every usable core busy all the time at the measured CPU per message:
        # what no overlap of the two ends' work can exceed at this cost.
        fed_ceiling = len(os.sched_getaffinity(0)) * 1e6 / max(fed.cpu_us, 1e-3)
        suite.value("federated_cpu_ceiling_per_s", fed_ceiling)
        suite.record("federated_relaxed_per_s", fed.per_s, "federated client -> hub (relaxed)",
                     f"{fed.per_s / fed_ceiling:.2f} x every core busy at its CPU per message "
                     f"({fed_ceiling:,.0f}/s); target >= 1,000,000")
        suite.record("federated_rtt_p50_us", p50, "federated round trip p50 (us)",
                     f"{p50 / echo_p50:.1f} x TLS echo; target < 1000")
        suite.record("federated_rtt_p99_us", p99, "federated round trip p99 (us)")
        gw = suite.gateway(pki, n)
        suite.sweep()
        suite.record("gateway_publish_durable_requests_per_s", gw["requests_per_s"],
                     "gateway durable publish, 1 message per request (HTTPS, 1 client)",
                     f"{gw['requests_per_s'] / durable[1].per_s:.2f} x Python publish")
        suite.record("gateway_publish_batch_100_durable_per_s", gw["batch_100_per_s"],
                     "gateway durable publish, 100 per request (msg/s)",
                     f"{gw['batch_100_per_s'] / batch[100].per_s:.2f} x publish_batch(100)")
        suite.record("gateway_sse_delivery_per_s", gw["sse_per_s"],
                     "gateway SSE delivery of a backlog (msg/s)",
                     f"{gw['sse_per_s'] / sub.per_s:.2f} x Python subscribe")
        rss = rss_idle_mb(Path(d))
        suite.record("rss_idle_local_mb", rss["local"], "RSS of an idle local messenger (MB)",
                     "above the interpreter", decimals=1)
        suite.record("rss_idle_client_mb", rss["client"], "RSS of an idle 2-hub client (MB)",
                     "above the interpreter; target < 20", decimals=1)
        suite.record("rss_idle_client_small_mb", rss["client-small"],
                     "RSS of an idle 2-hub client, small-board profile (MB)",
                     "above the interpreter; target < 10", decimals=1)
        suite.record("rss_idle_hub_10_peers_mb", rss["hub"],
                     "RSS of an idle hub, 10 peers (MB)", "above the interpreter", decimals=1)
        # CPU per message, from the timed loops above (process CPU, every thread).
        suite.value("cpu_us_per_raw_fdatasync", raw.cpu_us, decimals=1)
        suite.record("cpu_us_per_msg_publish_durable", durable[1].cpu_us,
                     "CPU per durable publish, 1 thread (us)",
                     f"{durable[1].cpu_us / raw.cpu_us:.1f} x raw write+fdatasync "
                     f"({raw.cpu_us:.1f} us)", decimals=1)
        suite.record("cpu_us_per_msg_publish_batch_100_durable", batch[100].cpu_us,
                     "CPU per message, publish_batch(100) (us)",
                     _per_core(batch[100].cpu_us), decimals=1)
        suite.record("cpu_us_per_msg_publish_relaxed", relaxed.cpu_us,
                     "CPU per relaxed publish (us)", _per_core(relaxed.cpu_us), decimals=1)
        suite.record("cpu_us_per_msg_subscribe", sub.cpu_us, "CPU per delivery (us)",
                     _per_core(sub.cpu_us), decimals=1)
        suite.record("cpu_us_per_msg_federated", fed.cpu_us,
                     "CPU per federated message, client and hub together (us)",
                     _per_core(fed.cpu_us), decimals=1)
        if one_core:
            one_core_comparison(suite, quick)
    return suite.results, suite.rows


def _publish_without_blocking(suite: Suite, one_thread: Sample) -> None:
    """Durable publish from the main thread, pipelined, and from asyncio tasks."""
    main = suite.median(suite.publish_main_thread)
    suite.record("publish_durable_main_thread_per_s", main.per_s,
                 "durable publish, main thread (Ctrl-C honoured)",
                 f"{main.per_s / one_thread.per_s:.2f} x 1 thread (a hand-off per commit)")
    piped = suite.median(suite.publish_pipelined)
    suite.record("publish_durable_pipelined_per_s", piped.per_s,
                 "durable publish(wait=False), 1 thread, 256 in flight",
                 f"{piped.per_s / one_thread.per_s:.1f} x 1 thread; target >= 10 x")
    aio1 = suite.median(partial(suite.publish_asyncio, 1))
    suite.record("publish_durable_asyncio_1_per_s", aio1.per_s,
                 "durable publish, 1 asyncio task", "")
    aio16 = suite.median(partial(suite.publish_asyncio, 16))
    suite.record("publish_durable_asyncio_16_per_s", aio16.per_s,
                 "durable publish, 16 asyncio tasks",
                 f"{aio16.per_s / aio1.per_s:.1f} x 1 task; target >= 10 x")


def _per_core(cpu_us: float) -> str:
    """What one busy core would sustain at this CPU cost per message."""
    return f"= {1e6 / cpu_us:,.0f}/s per busy core" if cpu_us > 0 else ""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``keyop-messenger bench``."""
    summary = __doc__.splitlines()[0].replace("``", "")  # reST quotes read as noise in --help
    ap = argparse.ArgumentParser(prog="keyop-messenger bench", description=summary)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="one short run of each (< 60 s)")
    ap.add_argument(
        "--one-core",
        action="store_true",
        help="also measure the main throughput figures pinned to one CPU and to two, and "
        f"compare them (target: one core >= {ONE_CORE_TARGET} x two cores; needs >= 2 CPUs)",
    )
    ap.add_argument(
        "--spark",
        action="store_true",
        help="measure the Spark data source instead: write and read against Spark's own JSON "
        "files on the same rows (needs pyspark and Java)",
    )
    ap.add_argument("--spark-rows", type=int, default=2_000_000, help="rows of --spark")
    ap.add_argument(
        "--spark-master",
        default="local[2],standalone",
        help="Spark masters of --spark, comma-separated; 'standalone' starts a local "
        "standalone cluster of two one-core workers (default: local[2],standalone)",
    )
    # Internal: the child process of --one-core.
    ap.add_argument("--pinned", metavar="CPUS", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pinned is not None:
        cpus = {int(c) for c in args.pinned.split(",")}
        figures = pinned_throughput(cpus, args.quick)
        print(json.dumps({key: list(sample) for key, sample in figures.items()}))
        return 0
    if args.spark:
        from .spark import bench as spark_bench

        masters = [m.strip() for m in args.spark_master.split(",") if m.strip()]
        results = spark_bench.run_masters(args.spark_rows, masters, 1 if args.quick else 3)
        rows = spark_bench.rows_of(results)
    else:
        results, rows = run(args.quick, args.one_core)
    if args.json:
        print(json.dumps(results, sort_keys=True))
        return 0
    print(f"{'case':<40} {'value':>12}  ratio")
    print("-" * 80)
    for label, value, ratio in rows:
        print(f"{label:<40} {value:>12}  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
