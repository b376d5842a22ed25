"""SIGHUP rotates certificates: ``run`` loads its ``tls`` files again (also
when they were replaced at the same paths); connections made from then on
use them, established ones stay up; a file that does not load is logged and
the running certificates stay."""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import threading
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import PKI, CertPair, Starter, client_config, stored_ids
from keyop_messenger import Config, FederationError, Messenger, TLSConfig
from run_helpers import WAIT_S, hub_doc, poll, running, write_config

pki = fed_helpers.pki
start = fed_helpers.start


def _der(pair: CertPair) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pair.cert.read_text())


def _copy(pair: CertPair, folder: Path) -> CertPair:
    """A private copy of ``pair`` (the session's files stay untouched)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = CertPair(folder / "instance.crt", folder / "instance.key")
    shutil.copy(pair.cert, out.cert)
    shutil.copy(pair.key, out.key)  # keeps the key's 0600
    return out


def _replace(target: CertPair, new: CertPair) -> None:
    """Rotation in place: the new files take the old paths."""
    for src, dst in ((new.cert, target.cert), (new.key, target.key)):
        tmp = dst.with_suffix(".new")
        shutil.copy(src, tmp)
        tmp.replace(dst)


def _hub_certificate(pki: PKI, port: int) -> bytes:
    """The certificate a new TLS connection to the hub at ``port`` sees."""
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki["node1"].cert), str(pki["node1"].key))
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _issue(pki: PKI, folder: Path, cn: str, *sans: str) -> CertPair:
    """Another certificate for ``cn`` from the same CA (a new serial)."""
    folder.mkdir(parents=True, exist_ok=True)
    return fed_helpers._instance(pki.ca, pki.ca_key, folder, cn, cn, *sans)


def test_sighup_rotates_the_hub_certificate(tmp_path: Path, pki: PKI, start: Starter) -> None:
    hub_dir = tmp_path / "hub"
    cert_a = _copy(pki["hub1"], tmp_path / "live")
    cert_b = _issue(pki, tmp_path / "b", "hub1", "localhost", "127.0.0.1")
    assert _der(cert_b) != _der(cert_a)
    doc = hub_doc(pki, hub_dir)
    doc["tls"].update(cert=str(cert_a.cert), key=str(cert_a.key))
    cfg = write_config(tmp_path / "hub.yaml", doc)
    with running(["--config", str(cfg)]) as hub:
        hub.wait_ready()
        port = hub.hub_port()
        node1 = start(client_config(pki, tmp_path / "n1", "node1", port, publish=["temps"]))
        first = node1.publish("temps", "t", 1)
        poll(lambda: stored_ids(hub_dir, "temps") == [first], "node1's record")
        assert _hub_certificate(pki, port) == _der(cert_a)

        _replace(cert_a, cert_b)  # same paths: the configuration file is unchanged
        hub.proc.send_signal(signal.SIGHUP)
        hub.wait_line(r"SIGHUP: TLS reloaded \(cert .*instance\.crt")
        assert _hub_certificate(pki, port) == _der(cert_b)

        # The federated client made before the rotation is still connected.
        second = node1.publish("temps", "t", 2)
        poll(lambda: stored_ids(hub_dir, "temps") == [first, second], "record after rotation")
        (link,) = node1.federation_status().clients
        assert link.connected and link.reconnects == 0, link

        # Nothing changed since: nothing is reloaded.
        hub.proc.send_signal(signal.SIGHUP)
        hub.wait_line(r"SIGHUP: configuration unchanged")
        assert hub.stop() == 0
    assert sum("TLS reloaded" in line for line in hub.lines) == 1, hub.lines


def test_sighup_keeps_the_running_certificate_when_the_new_one_is_broken(
    tmp_path: Path, pki: PKI
) -> None:
    cert_a = _copy(pki["hub1"], tmp_path / "live")
    doc = hub_doc(pki, tmp_path / "hub")
    doc["tls"].update(cert=str(cert_a.cert), key=str(cert_a.key))
    cfg = write_config(tmp_path / "hub.yaml", doc)
    with running(["--config", str(cfg)]) as hub:
        hub.wait_ready()
        port = hub.hub_port()
        cert_a.key.write_text("-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n")
        hub.proc.send_signal(signal.SIGHUP)
        line = hub.wait_line(r"ERROR .*SIGHUP: TLS not reloaded, the running .* stay: (.*)")
        assert str(cert_a.key) in line.group(1)
        assert _hub_certificate(pki, port) == _der(pki["hub1"])

        # A new certificate whose key was not replaced with it: refused too.
        shutil.copy(pki["hub1"].key, cert_a.key)
        cert_b = _issue(pki, tmp_path / "b", "hub1", "localhost", "127.0.0.1")
        shutil.copy(cert_b.cert, cert_a.cert)
        hub.proc.send_signal(signal.SIGHUP)
        hub.wait_line(r"TLS not reloaded, .*instance\.key\" is not the key of the certificate")
        assert _hub_certificate(pki, port) == _der(pki["hub1"])
        assert hub.proc.poll() is None
        assert hub.stop() == 0


class _RecordingServer:
    """A TLS listener on 127.0.0.1 standing in for a hub: it records the
    certificate each client presents, then closes the connection."""

    def __init__(self, pki: PKI) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(pki["hub1"].cert), str(pki["hub1"].key))
        self.ctx.load_verify_locations(str(pki.ca))
        self.ctx.verify_mode = ssl.CERT_REQUIRED
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.seen: list[bytes] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                raw, _ = self.sock.accept()
            except TimeoutError:
                continue
            raw.settimeout(5)
            try:
                with self.ctx.wrap_socket(raw, server_side=True) as tls:
                    der = tls.getpeercert(binary_form=True)
                    if der:
                        self.seen.append(der)
            except (OSError, ssl.SSLError):
                raw.close()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=WAIT_S)
        self.sock.close()


def test_sighup_rotates_the_client_certificate(tmp_path: Path, pki: PKI) -> None:
    cert_a = _copy(pki["node1"], tmp_path / "live")
    cert_b = _issue(pki, tmp_path / "b", "node1")
    server = _RecordingServer(pki)
    try:
        doc = {
            "name": "node1",
            "storage": {"data_dir": str(tmp_path / "n1")},
            "client": {
                "enabled": True,
                "hubs": [{"addr": f"localhost:{server.port}", "publish": ["temps"]}],
            },
            "tls": {"cert": str(cert_a.cert), "key": str(cert_a.key), "ca": str(pki.ca)},
            "federation": {"reconnect_base_ms": 50, "reconnect_max_ms": 200},
        }
        cfg = write_config(tmp_path / "node1.yaml", doc)
        with running(["--config", str(cfg)]) as node:
            node.wait_ready()
            poll(lambda: _der(pki["node1"]) in server.seen, "a dial with certificate A")
            _replace(cert_a, cert_b)
            node.proc.send_signal(signal.SIGHUP)
            node.wait_line(r"SIGHUP: TLS reloaded")
            poll(lambda: server.seen[-1] == _der(cert_b), "a dial with certificate B")
            assert node.stop() == 0
    finally:
        server.close()


def test_reload_tls_needs_federation(tmp_path: Path, pki: PKI) -> None:
    with Messenger(Config.from_dict({"storage": {"data_dir": str(tmp_path / "d")}})) as m:
        with pytest.raises(FederationError, match="not running"):
            m.reload_tls(
                TLSConfig(cert=str(pki["hub1"].cert), key=str(pki["hub1"].key), ca=str(pki.ca))
            )
