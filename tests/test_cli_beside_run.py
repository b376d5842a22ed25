"""Operator commands next to a running instance: ``stats``, ``tail`` and
``dead-letters list`` read the files without the lock; ``pub`` fails naming
the process that holds the data directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import PKI, Starter, client_config, stored_ids
from keyop_messenger import DataDirNotFoundError, _core
from run_helpers import WAIT_S, hub_doc, poll, running, write_config

pki = fed_helpers.pki
start = fed_helpers.start


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyop_messenger", *argv],
        capture_output=True, text=True, timeout=WAIT_S * 3,
    )  # fmt: skip


def test_operator_commands_beside_a_running_instance(
    tmp_path: Path, pki: PKI, start: Starter
) -> None:
    hub_dir = tmp_path / "hub"
    cfg = str(write_config(tmp_path / "hub.yaml", hub_doc(pki, hub_dir)))
    with running(["--config", cfg]) as hub:
        hub.wait_ready()
        node = start(client_config(pki, tmp_path / "node1", "node1", hub.hub_port(),
                                   publish=["temps"]))  # fmt: skip
        ids = [node.publish("temps", "reading", {"n": i}) for i in range(4)]
        poll(lambda: stored_ids(hub_dir, "temps") == ids, "the readings on the hub")

        stats = cli("stats", "--config", cfg, "--json")
        assert stats.returncode == 0, stats.stderr
        channels = {c["name"]: c for c in json.loads(stats.stdout)["channels"]}
        assert channels["temps"]["stream_bytes"] == fed_helpers.stream_end(hub_dir, "temps")
        assert channels["temps"]["disk_bytes"] == channels["temps"]["stream_bytes"] > 0
        table = cli("stats", "--config", cfg)
        assert table.returncode == 0 and "temps" in table.stdout

        tail = cli("tail", "--data-dir", str(hub_dir), "temps", "-n", "2")
        assert tail.returncode == 0, tail.stderr
        assert [json.loads(x)["id"] for x in tail.stdout.splitlines()] == ids[-2:]
        dead = cli("dead-letters", "list", "--data-dir", str(hub_dir), "temps")
        assert dead.returncode == 0, dead.stderr

        pub = cli("pub", "--config", cfg, "temps", "reading", '{"n": 9}')
        assert pub.returncode == 1
        assert f"held by process {hub.proc.pid}" in pub.stderr, pub.stderr
        assert hub.stop() == 0
    assert stored_ids(hub_dir, "temps") == ids


def test_read_stats_of_a_missing_data_dir(tmp_path: Path) -> None:
    with pytest.raises(DataDirNotFoundError):
        _core.read_stats(str(tmp_path / "nope"))


def test_sub_from_reads_the_files_beside_a_running_instance(
    tmp_path: Path, pki: PKI, start: Starter
) -> None:
    hub_dir = tmp_path / "hub"
    cfg = str(write_config(tmp_path / "hub.yaml", hub_doc(pki, hub_dir)))
    with running(["--config", cfg]) as hub:
        hub.wait_ready()
        node = start(client_config(pki, tmp_path / "node1", "node1", hub.hub_port(),
                                   publish=["temps"]))  # fmt: skip
        ids = [node.publish("temps", "reading", {"n": i}) for i in range(3)]
        poll(lambda: stored_ids(hub_dir, "temps") == ids, "the readings on the hub")
        everything = cli("sub", "--config", cfg, "temps", "--from", "0", "--count", "3")
        assert everything.returncode == 0, everything.stderr
        docs = [json.loads(x) for x in everything.stdout.splitlines()]
        assert [d["id"] for d in docs] == ids and docs[0]["offset"] == 0
        rest = cli("sub", "--config", cfg, "temps", "--from", str(docs[1]["offset"]),
                   "--count", "5", "--timeout", "0.5")  # fmt: skip
        assert rest.returncode == 1 and "received 2 of 5 messages" in rest.stderr
        assert [json.loads(x)["id"] for x in rest.stdout.splitlines()] == ids[1:]
        # Nothing was acknowledged or created: no subscriber offset files.
        assert not (hub_dir / "subscribers" / "temps").exists() or not [
            p for p in (hub_dir / "subscribers" / "temps").iterdir()
            if not p.name.startswith("fed-")
        ]  # fmt: skip
        assert hub.stop() == 0
