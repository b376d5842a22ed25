"""SIGHUP: ``run`` reads its configuration again and applies
``hub.allowed_peers`` (peers removed or changed are disconnected); other
changes are logged as needing a restart; a bad file keeps the running one."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import PKI, Starter, audit_events, client_config, peer, stored_ids
from keyop_messenger import Config, FederationError, Messenger
from run_helpers import WAIT_S, hub_doc, poll, running, write_config

pki = fed_helpers.pki
start = fed_helpers.start


def test_sighup_reloads_allowed_peers(tmp_path: Path, pki: PKI, start: Starter) -> None:
    hub_dir = tmp_path / "hub"
    doc = hub_doc(pki, hub_dir)
    doc["hub"]["allowed_peers"] = [peer("node1", publish=["temps"])]
    cfg = write_config(tmp_path / "hub.yaml", doc)
    with running(["--config", str(cfg)]) as hub:
        hub.wait_ready()
        port = hub.hub_port()
        node1 = start(client_config(pki, tmp_path / "n1", "node1", port, publish=["temps"]))
        node2 = start(client_config(pki, tmp_path / "n2", "node2", port, publish=["temps"]))
        first = node1.publish("temps", "t", 1)
        poll(lambda: stored_ids(hub_dir, "temps") == [first], "node1's record")
        early = node2.publish("temps", "t", 2)
        hub.wait_line(r"rejected peer \"node2\"")

        doc["hub"]["allowed_peers"] = [peer("node2", publish=["temps"])]
        doc["hub"]["listen_addr"] = "127.0.0.1:1"  # needs a restart: only logged
        write_config(cfg, doc)
        hub.proc.send_signal(signal.SIGHUP)
        hub.wait_line(r"allowed_peers reloaded \(1 peers\); disconnected: node1$")
        hub.wait_line(r"SIGHUP: hub\.listen_addr changed: restart to apply")
        poll(lambda: early in stored_ids(hub_dir, "temps"), "node2's record once allowed")
        # The reload is audited (an event 1.4 defines and never writes).
        (reloaded,) = audit_events(hub_dir, "policy_reloaded")
        assert reloaded["detail"] == "peers=1 disconnected=[node1]", reloaded
        late = node1.publish("temps", "t", 3)
        hub.wait_line(r"rejected peer \"node1\"")
        assert late not in stored_ids(hub_dir, "temps")

        (tmp_path / "hub.yaml").write_text("storage: {data_dir: 5}\n")
        hub.proc.send_signal(signal.SIGHUP)
        hub.wait_line(r"configuration \S+ not reloaded: storage\.data_dir: must be a string")
        assert hub.proc.poll() is None
        assert hub.stop() == 0


def test_set_allowed_peers_needs_a_hub(tmp_path: Path) -> None:
    with Messenger(Config.from_dict({"storage": {"data_dir": str(tmp_path / "d")}})) as m:
        with pytest.raises(FederationError, match="no hub"):
            m.set_allowed_peers([])



def test_sighup_reloads_the_log_level(tmp_path: Path, pki: PKI) -> None:
    port = fed_helpers.free_port()
    doc = hub_doc(pki, tmp_path / "hub", log={"level": "warning"})
    doc["hub"]["listen_addr"] = f"127.0.0.1:{port}"
    cfg = write_config(tmp_path / "hub.yaml", doc)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(tmp_path / "n.sock"))
        notify.settimeout(WAIT_S)
        env = {"NOTIFY_SOCKET": str(tmp_path / "n.sock")}
        with running(["--config", str(cfg)], env=env) as hub:
            while b"READY=1" not in notify.recv(4096).split(b"\n"):
                pass
            doc["log"] = {"level": "info"}
            write_config(cfg, doc)
            hub.proc.send_signal(signal.SIGHUP)
            hub.wait_line(r"SIGHUP: log level now info")
            # An engine record at INFO now passes (pyo3-log's level cache was reset).
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            hub.wait_line(r"INFO keyop_messenger\.keyop_core\.federation\.hub: .*connection from")
            assert hub.stop() == 0
    before = hub.lines[: next(i for i, x in enumerate(hub.lines) if "log level now" in x)]
    assert not any(" INFO " in line for line in before), before
