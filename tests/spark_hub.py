"""A keyop hub in its own process, for the Spark tests (tests/test_spark.py).

    python tests/spark_hub.py --data-dir DIR --cert C --key K --ca CA \\
        --peer spark-writer --channel rows [--channel more] --out received.jsonl \\
        [--segment-mb 1] [--hold]

Starts a hub named ``hub1`` listening on 127.0.0.1 (a free port) that allows
the given peers, subscribes to every ``--channel`` (subscriber id
``spark-test``, so it receives everything published after start-up) and
appends each message it receives to ``--out`` as one JSON line
``{"channel", "id", "origin", "payload_type", "service_name",
"correlation_id", "ts", "payload"}`` (flushed per message). Once listening it
prints ``PORT <port>`` on stdout. It runs until SIGTERM/SIGINT or until its
stdin is closed, then closes the messenger (persisting subscriber offsets)
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from keyop_messenger import Config, Message, Messenger


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--ca", required=True)
    ap.add_argument("--peer", action="append", default=[], help="allowed peer name")
    ap.add_argument("--channel", action="append", default=[], help="channel to record")
    ap.add_argument("--out", required=True, help="JSON-lines file of received messages")
    ap.add_argument("--segment-mb", type=int, default=256, help="segment_size_mb")
    ap.add_argument("--name", default="hub1")
    ap.add_argument(
        "--hold",
        action="store_true",
        help="keep every segment of the channels: an offset file at 0 (subscriber "
        "'spark-hold') stops retention from deleting what the recorder consumed",
    )
    args = ap.parse_args(argv)
    if args.hold:
        for channel in args.channel:
            folder = Path(args.data_dir) / "subscribers" / channel
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "spark-hold.offset").write_text("0\n")

    config = Config.from_dict(
        {
            "name": args.name,
            "storage": {"data_dir": args.data_dir, "segment_size_mb": args.segment_mb},
            "hub": {
                "enabled": True,
                "listen_addr": "127.0.0.1:0",
                "allowed_peers": [{"name": p} for p in args.peer],
            },
            "tls": {"cert": args.cert, "key": args.key, "ca": args.ca},
        }
    )
    stop = threading.Event()
    lock = threading.Lock()
    out = open(args.out, "a", encoding="utf-8")  # closed after the messenger

    def record(msg: Message) -> None:
        line: dict[str, Any] = {
            "channel": msg.channel,
            "id": msg.id,
            "origin": msg.origin,
            "payload_type": msg.payload_type,
            "service_name": msg.service_name,
            "correlation_id": msg.correlation_id,
            "ts": msg.timestamp.isoformat(),
            "payload": msg.payload,
        }
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with lock:
            out.write(text)
            out.flush()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def watch_stdin() -> None:
        try:
            while sys.stdin.read(4096):
                pass
        except (OSError, ValueError):
            pass
        stop.set()

    with Messenger(config) as hub:
        for channel in args.channel:
            hub.subscribe(channel, "spark-test", record)
        addr = hub.hub_address
        assert addr is not None
        print(f"PORT {addr[1]}", flush=True)
        threading.Thread(target=watch_stdin, daemon=True).start()
        while not stop.wait(0.2):
            pass
    with lock:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
