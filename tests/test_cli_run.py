"""``keyop-messenger run``: one instance in the foreground until SIGTERM/SIGINT,
exit statuses 0 / 1 / 2, and ``--check``."""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import PKI, Inbox, Starter, client_config, stored_ids
from run_helpers import hub_doc, poll, run_once, running, write_config

pki = fed_helpers.pki
start = fed_helpers.start

ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def test_run_serves_until_sigterm_and_keeps_the_data(
    tmp_path: Path, pki: PKI, start: Starter
) -> None:
    hub_dir = tmp_path / "hub"
    cfg = write_config(tmp_path / "hub.yaml", hub_doc(pki, hub_dir))
    with running(["--config", str(cfg)]) as hub:
        hub.wait_ready()
        port = hub.hub_port()
        node = start(
            client_config(pki, tmp_path / "node1", "node1", port, publish=["temps"],
                          subscribe=["commands"])
        )  # fmt: skip
        ids = [node.publish("temps", "reading", {"n": i}) for i in range(5)]
        poll(lambda: stored_ids(hub_dir, "temps") == ids, "the readings on the hub")
        assert hub.stop(signal.SIGTERM) == 0
        assert any("stopping" in line for line in hub.lines), hub.lines
    assert stored_ids(hub_dir, "temps") == ids
    # The data directory is released: a new instance opens it.
    with running(["--config", str(cfg)]) as again:
        again.wait_ready()
        assert again.stop(signal.SIGINT) == 0


def test_run_delivers_to_a_client_and_stops_on_sigint(
    tmp_path: Path, pki: PKI, start: Starter
) -> None:
    hub_dir = tmp_path / "hub"
    cfg = write_config(tmp_path / "hub.yaml", hub_doc(pki, hub_dir))
    with running(["--config", str(cfg)]) as hub:
        hub.wait_ready()
        node = start(
            client_config(pki, tmp_path / "node1", "node1", hub.hub_port(),
                          subscribe=["commands"])
        )  # fmt: skip
        inbox = Inbox()
        node.subscribe("commands", "actuator", inbox)
        fed_helpers.wait_connected(node)
        assert hub.stop(signal.SIGINT) == 0
    assert inbox.messages == []


def test_bad_config_exits_2_naming_file_and_key(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path / "bad.yaml",
        {"storage": {"data_dir": 5}, "hub": {"enabled": True, "listen_addr": "nowhere"}},
    )
    result = run_once(["--config", str(cfg)])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert f"Error: {cfg}: storage.data_dir: must be a string, got integer 5" in result.stderr
    assert any(
        line.startswith(f"Error: {cfg}: hub.listen_addr: must be host:port") for line in lines
    ), lines
    missing = run_once(["--config", str(tmp_path / "absent.yaml")])
    assert missing.returncode == 2
    assert f"{tmp_path / 'absent.yaml'}: cannot read configuration file" in missing.stderr
    usage = run_once([])
    assert usage.returncode == 2 and "--config" in usage.stderr
    # Arguments run does not take, and -v with -q, are usage errors too.
    for args in (["--bogus"], ["-v", "-q"]):
        usage = run_once(["--config", str(cfg), *args])
        assert usage.returncode == 2, (args, usage.stderr)
        assert usage.stderr.startswith("Error: keyop-messenger run: "), usage.stderr


def test_check_validates_without_starting(tmp_path: Path, pki: PKI) -> None:
    data_dir = tmp_path / "never"
    cfg = write_config(tmp_path / "hub.yaml", hub_doc(pki, data_dir))
    result = run_once(["--config", str(cfg), "--check"])
    assert result.returncode == 0, result.stderr
    assert "configuration OK" in result.stdout
    assert not data_dir.exists()


def test_check_and_run_warn_of_a_certificate_expiring_soon_naming_it(
    tmp_path: Path, pki: PKI
) -> None:
    from keyop_messenger._pki import write_instance

    cert, key = tmp_path / "soon.crt", tmp_path / "soon.key"
    write_instance(
        str(pki.ca), str(pki.ca_key), "hub1", out_cert=str(cert), out_key=str(key), days=5,
        sans=["127.0.0.1"],
    )  # fmt: skip
    doc = hub_doc(pki, tmp_path / "data")
    doc["tls"] = {"cert": str(cert), "key": str(key), "ca": str(pki.ca)}
    cfg = write_config(tmp_path / "hub.yaml", doc)
    result = run_once(["--config", str(cfg), "--check"])
    assert result.returncode == 0, result.stderr
    assert "configuration OK" in result.stdout
    assert re.search(
        rf"Warning: {re.escape(str(cfg))}: tls\.cert: {re.escape(str(cert))}: certificate "
        rf"'CN=hub1' expires on {ISO}, within tls\.expiry_warn_days \(30\)",
        result.stderr,
    ), result.stderr
    assert "tls.ca" not in result.stderr, "the CA is valid for years"
    with running(["--config", str(cfg)]) as hub:
        hub.wait_line(rf"instance certificate {re.escape(str(cert))} \(CN=hub1\) expires within 30")
        assert hub.stop() == 0


def _expired_certificate(pki: PKI, out: Path) -> tuple[Path, Path, tuple[str, str]]:
    """A certificate for ``hub1`` signed by the test CA that expired yesterday
    (keygen refuses to make one)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_cert = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hub1")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=10))
        .not_valid_after(now - datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("hub1")]), False)
        .sign(ca_key, hashes.SHA384())
    )
    cert_path, key_path = out / "old.crt", out / "old.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    os.chmod(key_path, 0o600)
    dates = tuple(
        t.strftime("%Y-%m-%dT%H:%M:%SZ")
        for t in (cert.not_valid_before_utc, cert.not_valid_after_utc)
    )
    return cert_path, key_path, (dates[0], dates[1])


def test_check_refuses_an_expired_certificate_naming_its_dates(
    tmp_path: Path, pki: PKI
) -> None:
    cert, key, dates = _expired_certificate(pki, tmp_path)
    doc = hub_doc(pki, tmp_path / "data")
    doc["tls"] = {"cert": str(cert), "key": str(key), "ca": str(pki.ca)}
    cfg = write_config(tmp_path / "hub.yaml", doc)
    result = run_once(["--config", str(cfg), "--check"])
    assert result.returncode == 2, result.stderr
    found = re.search(
        rf"Error: {re.escape(str(cfg))}: tls\.cert: {re.escape(str(cert))}: certificate "
        rf"'CN=hub1' expired on ({ISO}) \(valid from ({ISO}) until ({ISO})",
        result.stderr,
    )
    assert found, result.stderr
    assert found.group(1) == found.group(3)
    assert (found.group(2), found.group(3)) == dates
    # Without --check the same configuration does not start either.
    assert run_once(["--config", str(cfg)]).returncode == 2
    assert not (tmp_path / "data").exists()


def test_keygen_inspect_says_a_certificate_has_expired(
    tmp_path: Path, pki: PKI, capsys: pytest.CaptureFixture[str]
) -> None:
    from keyop_messenger.cli import main

    cert, _, dates = _expired_certificate(pki, tmp_path)
    assert main(["keygen", "inspect", str(cert)]) == 0
    out = capsys.readouterr().out
    assert f"Valid until: {dates[1]}\n" in out, out
    assert "Status:      EXPIRED 1 day ago\n" in out, out
    assert main(["keygen", "inspect", str(pki.ca)]) == 0
    assert "Status:      valid (expires in " in capsys.readouterr().out


def test_check_reports_unreadable_files_and_bad_data_dir(tmp_path: Path, pki: PKI) -> None:
    (tmp_path / "file").write_text("x")
    doc = hub_doc(pki, tmp_path / "file")
    doc["tls"] = dict(doc["tls"], ca=str(tmp_path / "missing-ca.crt"))
    cfg = write_config(tmp_path / "hub.yaml", doc)
    result = run_once(["--config", str(cfg), "--check"])
    assert result.returncode == 2
    assert f"tls.ca: cannot read {tmp_path / 'missing-ca.crt'}" in result.stderr
    assert f"storage.data_dir: {tmp_path / 'file'} exists and is not a directory" in result.stderr


def test_check_tries_whether_the_data_dir_can_be_created(tmp_path: Path, pki: PKI) -> None:
    # Permission bits do not tell (root may write anywhere by them; /proc is
    # 0555 but root's bits pass): --check tries, and leaves nothing behind.
    bad = hub_doc(pki, Path("/proc/keyop-check-data"))
    result = run_once(["--config", str(write_config(tmp_path / "bad.yaml", bad)), "--check"])
    assert result.returncode == 2, result.stderr
    assert "storage.data_dir: /proc/keyop-check-data does not exist and cannot be created" in (
        result.stderr
    )
    good = hub_doc(pki, tmp_path / "nested" / "data")
    result = run_once(["--config", str(write_config(tmp_path / "good.yaml", good)), "--check"])
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "good.yaml"]


def test_check_loads_the_tls_files_as_run_does(tmp_path: Path, pki: PKI) -> None:
    """What federation refuses when it loads the files, --check refuses too
    (exit 2, so a service manager does not restart in a loop): a key readable
    by its group, a key of another certificate."""
    loose = tmp_path / "loose.key"
    loose.write_bytes(pki["hub1"].key.read_bytes())
    loose.chmod(0o640)
    cases = {
        "is readable or writable by group or others (mode 0640)": str(loose),
        "is not the key of the certificate in tls.cert": str(pki["node1"].key),
    }
    for expected, key in cases.items():
        doc = hub_doc(pki, tmp_path / "data")
        doc["tls"] = dict(doc["tls"], key=key)
        cfg = write_config(tmp_path / "hub.yaml", doc)
        for args in (["--check"], []):
            result = run_once(["--config", str(cfg), *args])
            assert result.returncode == 2, (args, result.stderr)
            assert f"Error: {cfg}: tls.key " in result.stderr and expected in result.stderr
    assert not (tmp_path / "data").exists()


def test_runtime_failure_exits_1(tmp_path: Path, pki: PKI) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        doc = hub_doc(pki, tmp_path / "hub")
        doc["hub"]["listen_addr"] = f"127.0.0.1:{port}"
        cfg = write_config(tmp_path / "hub.yaml", doc)
        result = run_once(["--config", str(cfg)])
    assert result.returncode == 1, result.stderr
    assert "ERROR" in result.stderr and str(port) in result.stderr


def test_sighup_does_not_stop_the_instance(tmp_path: Path, pki: PKI) -> None:
    cfg = write_config(tmp_path / "hub.yaml", hub_doc(pki, tmp_path / "hub"))
    with running(["--config", str(cfg)]) as hub:
        hub.wait_ready()
        hub.proc.send_signal(signal.SIGHUP)
        hub.wait_line("SIGHUP")
        socket.create_connection(("127.0.0.1", hub.hub_port()), timeout=5).close()
        assert hub.proc.poll() is None
        assert hub.stop() == 0
