"""The demo (``keyop-messenger demo``, ``examples/demo.py``): two instances
federating over mutual TLS on localhost.

1. Makes a CA and two instance certificates with the built-in keygen.
2. Starts a hub ("demo-hub") on 127.0.0.1 (a free port) that lets the sensor
   publish `temps` and receive `commands`.
3. Starts a client ("demo-sensor") that dials the hub, publishes readings
   durably on `temps` and subscribes to `commands`.
4. Shows what each side received and the hub's audit log, then cleans up.

Everything lives in a temporary directory that is removed at the end. It is
part of the package so that an installed wheel runs it; its output is the
command's output (print).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path

import keyop_messenger as km
from keyop_messenger._pki import write_ca, write_instance

__all__ = ["DemoFailed", "main"]


@dataclasses.dataclass
class Reading:
    sensor: str
    celsius: float


def make_pki(d: Path) -> None:
    """CA plus one certificate per instance (CN = instance name)."""
    print(f"$ cd {d}")
    print("$ keyop-messenger keygen ca")
    print(write_ca(f"{d}/ca.crt", f"{d}/ca.key"))
    for name in ("demo-hub", "demo-sensor"):
        print(
            f"$ keyop-messenger keygen instance --ca ca.crt --ca-key ca.key --name {name}"
            " --san localhost --san 127.0.0.1"
        )
        print(
            write_instance(
                f"{d}/ca.crt", f"{d}/ca.key", name, sans=["localhost", "127.0.0.1"],
                out_cert=f"{d}/{name}.crt", out_key=f"{d}/{name}.key",
            )
        )  # fmt: skip


def tls(d: Path, name: str) -> dict[str, str]:
    return {"cert": f"{d}/{name}.crt", "key": f"{d}/{name}.key", "ca": f"{d}/ca.crt"}


class DemoFailed(Exception):
    """Something the demo waits for did not arrive."""


def wait_for(what: str, done: threading.Event, seconds: float = 15.0) -> None:
    if not done.wait(seconds):
        raise DemoFailed(f"demo failed: {what} did not arrive within {seconds:.0f} s")


def main() -> None:
    """Runs the demo in a temporary directory (removed at the end)."""
    with tempfile.TemporaryDirectory(prefix="keyop-demo-") as tmp:
        d = Path(tmp)
        make_pki(d)
        hub = km.Messenger(km.Config.from_dict({
            "name": "demo-hub",
            "storage": {"data_dir": f"{d}/hub"},
            "hub": {
                "enabled": True,
                "listen_addr": "127.0.0.1:0",
                "allowed_peers": [
                    {"name": "demo-sensor", "publish": ["temps"], "subscribe": ["commands"]}
                ],
            },
            "tls": tls(d, "demo-hub"),
        }))  # fmt: skip
        host, port = hub.hub_address or ("", 0)
        print(f"\nhub 'demo-hub' listening on {host}:{port} (TLS 1.3, client certs required)")
        sensor = km.Messenger(km.Config.from_dict({
            "name": "demo-sensor",
            "storage": {"data_dir": f"{d}/sensor"},
            "client": {
                "enabled": True,
                "hubs": [
                    {"addr": f"127.0.0.1:{port}", "publish": ["temps"], "subscribe": ["commands"]}
                ],
            },
            "tls": tls(d, "demo-sensor"),
            "federation": {"reconnect_base_ms": 100},
        }))  # fmt: skip
        try:
            readings: list[km.Message] = []
            all_readings, command_seen = threading.Event(), threading.Event()

            def on_reading(m: km.Message) -> None:
                readings.append(m)
                print(f"  hub    <- {m.channel}: {m.payload} from {m.origin}")
                if len(readings) == 5:
                    all_readings.set()

            def on_command(m: km.Message) -> None:
                print(f"  sensor <- {m.channel}: {m.payload} from {m.origin}")
                command_seen.set()

            hub.register_payload_type("demo.Reading", Reading)
            hub.subscribe("temps", "dashboard", on_reading)
            sensor.subscribe("commands", "actuator", on_command)

            print("\nsensor publishes 5 readings (each fsynced before publish returns):")
            with km.context(service_name="thermometer"):
                for i in range(5):
                    sensor.publish("temps", "demo.Reading", Reading("kitchen", 20.0 + i / 2))
            wait_for("the readings", all_readings)

            print("\nhub publishes a command for the sensor:")
            hub.publish("commands", "demo.Command", {"action": "calibrate"})
            wait_for("the command", command_seen)

            time.sleep(0.2)  # let the last audit records land
            print("\nhub audit log (audit/audit.jsonl):")
            for line in (d / "hub" / "audit" / "audit.jsonl").read_text().splitlines():
                rec = json.loads(line)
                print("  " + " ".join(f"{k}={v}" for k, v in rec.items() if k != "ts"))
            links = [dataclasses.asdict(c) for c in sensor.federation_status().clients]
            print("\nfederation:", json.dumps(links))
        finally:
            sensor.close()
            hub.close()
    print("\ndemo finished: 5 readings and 1 command crossed the mTLS link")

