"""The small-board profile: ``KEYOP_MESSENGER_WORKER_THREADS`` sets how many
worker threads the engine's federation runtime runs.

The runtime is one per process, so each case runs a client messenger with two
hubs in a child process, which counts its threads by name in /proc/self/task.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = "KEYOP_MESSENGER_WORKER_THREADS"
CHILD_TIMEOUT_S = 60

# A client with two hubs (127.0.0.1:9, where nothing listens: it keeps
# redialling); prints the names of its threads once the runtime runs.
CHILD = """
import sys, time
from pathlib import Path
import keyop_messenger as km
from keyop_messenger import _core

pki = Path(sys.argv[1])
_core.keygen_ca(pki / "ca.crt", pki / "ca.key")
_core.keygen_instance(pki / "ca.crt", pki / "ca.key", "small", pki / "small.crt",
                      pki / "small.key", sans=["127.0.0.1"])
cfg = km.Config.from_dict({
    "name": "small",
    "storage": {"data_dir": str(pki / "data")},
    "tls": {"cert": str(pki / "small.crt"), "key": str(pki / "small.key"),
            "ca": str(pki / "ca.crt")},
    "client": {"enabled": True, "hubs": [
        {"addr": "127.0.0.1:9", "publish": ["a"]},
        {"addr": "127.0.0.1:9", "publish": ["b"]},
    ]},
})
try:
    m = km.Messenger(cfg)
except km.KeyopError as exc:
    print("error:", exc)
    raise SystemExit(0)
with m:
    m.publish("a", "t", {"n": 1})
    time.sleep(0.3)
    names = [(t / "comm").read_text().strip()
             for t in Path("/proc/self/task").iterdir()]
    print("threads:", ",".join(sorted(names)))
"""


def run_child(tmp_path: Path, value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if value is not None:
        env[ENV] = value
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=True)
    return out.stdout.strip().splitlines()[-1]


def worker_count(line: str) -> int:
    assert line.startswith("threads: "), line
    return line.removeprefix("threads: ").split(",").count("keyop-fed")


def test_small_profile_runs_one_worker_thread(tmp_path: Path) -> None:
    assert worker_count(run_child(tmp_path, "1")) == 1


def test_default_runs_two_worker_threads(tmp_path: Path) -> None:
    assert worker_count(run_child(tmp_path, None)) == 2


@pytest.mark.parametrize("value", ["0", "many"])
def test_bad_worker_threads_value_is_a_named_error(tmp_path: Path, value: str) -> None:
    line = run_child(tmp_path, value)
    assert line.startswith("error:"), line
    assert ENV in line and "from 1 to 64" in line
