"""keyop-messenger demo: durable publish on a local channel, then read it back.

Runs in a temporary data directory and removes it afterwards.
"""

from __future__ import annotations

import dataclasses
import tempfile

import keyop_messenger as km


@dataclasses.dataclass
class Reading:
    sensor: str
    celsius: float


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="keyop-demo-") as data_dir:
        config = km.Config.from_dict({"name": "demo-node", "storage": {"data_dir": data_dir}})
        with km.Messenger(config) as messenger:
            messenger.register_payload_type("demo.Reading", Reading)
            with km.context(service_name="demo", correlation_id="run-1"):
                first = messenger.publish("temps", "demo.Reading", Reading("kitchen", 21.5))
                rest = messenger.publish_batch(
                    "temps",
                    [("demo.Reading", Reading(f"room-{i}", 19.0 + i)) for i in range(3)],
                )
            print(f"published {1 + len(rest)} messages (durable, fsynced); first id {first}")
            for entry in messenger.read_channel("temps"):
                m = entry.message
                print(
                    f"  @{entry.offset:<5} {m.timestamp:%H:%M:%S.%f} {m.origin}/{m.service_name} "
                    f"{m.payload_type} {m.payload}"
                )
        print("segment file:")
        with open(f"{data_dir}/channels/temps/00000000000000000000.jsonl") as f:
            print("  " + f.readline().strip())


if __name__ == "__main__":
    main()
