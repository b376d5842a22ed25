"""Child process of test_subscribe.py's SIGKILL test.

Usage: ``python subscribe_child.py <data_dir> <out_file> <mode> [count]``.

It subscribes to channel ``killed`` as subscriber ``victim`` (offsets flushed
at most every 200 ms) with a handler that appends each delivered message id to
``out_file`` as one line, flushed and fsynced before the handler returns, so
every line in the file is a delivery whose handler call was (about to be)
acknowledged.

* mode ``run``: also publishes ``count`` messages, one at a time, while
  delivery runs; the parent kills the process with SIGKILL mid-delivery.
* mode ``resume``: publishes one sentinel message after subscribing and exits
  (status 0, printing ``done``) once it has been delivered; everything
  before it was delivered by then, as delivery is in order.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from keyop_messenger import Config, Message, Messenger

CHANNEL = "killed"
SUBSCRIBER = "victim"
PAYLOAD_TYPE = "kill.Test"
FLUSH_INTERVAL_MS = 200
#: Bound on how long the child waits for its last delivery.
DEADLINE_S = 60.0


def main(data_dir: str, out_file: str, mode: str, count: int) -> int:
    if mode not in ("run", "resume"):
        raise SystemExit(f"unknown mode {mode!r}; use 'run' or 'resume'")
    config = Config.from_dict(
        {
            "name": "kill-child",
            "storage": {"data_dir": data_dir, "offset_flush_interval_ms": FLUSH_INTERVAL_MS},
        }
    )
    if mode == "resume":
        count = 1
    target: dict[str, str | None] = {"id": None}
    seen: set[str] = set()
    lock = threading.Lock()
    finished = threading.Event()
    out = open(out_file, "a", encoding="ascii")

    def handle(msg: Message) -> None:
        out.write(msg.id + "\n")
        out.flush()
        os.fsync(out.fileno())
        with lock:
            seen.add(msg.id)
            if msg.id == target["id"]:
                finished.set()
        time.sleep(0.005)  # delivery slower than publishing: killed mid-way

    try:
        with Messenger(config) as m:
            m.subscribe(CHANNEL, SUBSCRIBER, handle)
            for n in range(count):
                mid = m.publish(CHANNEL, PAYLOAD_TYPE, {"n": n, "mode": mode})
                if n == count - 1:
                    with lock:
                        target["id"] = mid
                        if mid in seen:
                            finished.set()
                time.sleep(0.001)
            if not finished.wait(DEADLINE_S):
                print("timed out waiting for the last delivery", flush=True)
                return 1
        print("done", flush=True)
        return 0
    finally:
        out.close()


if __name__ == "__main__":
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], count))
