"""The ``keyop-messenger`` command: ``version`` and ``keygen`` (shared/spec/cli.md).

Most tests call ``main([...])`` in-process; one runs the module as a subprocess.
Certificate fields are checked with the ``cryptography`` package when it is
installed, and through ``keygen inspect`` otherwise.
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
import stat
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from keyop_messenger import __version__
from keyop_messenger.cli import main

SUMMARY = re.compile(
    r"\ASubject:     (?P<subject>.+)\n"
    r"Valid from:  (?P<start>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\n"
    r"Valid until: (?P<end>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\n"
    r"Fingerprint: SHA-256:(?P<fp>[0-9a-f]{64})\n\Z"
)


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """Runs the command in-process: (exit status, stdout, stderr)."""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def parse_time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def inspect_fields(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, str]:
    status, out, err = run(capsys, "keygen", "inspect", path)
    assert (status, err) == (0, "")
    fields = {}
    for line in out.splitlines():
        label, value = line[:13].rstrip(), line[13:]
        assert label.endswith(":") and value, line
        fields[label[:-1]] = value
    return fields


@pytest.fixture
def ca(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    """A CA made by ``keygen ca`` in ``tmp_path``: (certificate, key)."""
    cert, key = tmp_path / "ca.crt", tmp_path / "ca.key"
    status, _, err = run(capsys, "keygen", "ca", "--out-cert", cert, "--out-key", key)
    assert (status, err) == (0, "")
    return cert, key


def make_instance(
    capsys: pytest.CaptureFixture[str], ca: tuple[Path, Path], name: str, *extra: str
) -> tuple[Path, Path, str]:
    """``keygen instance`` for ``name`` beside the CA: (certificate, key, stdout)."""
    out_dir = ca[0].parent
    cert, key = out_dir / f"{name}.crt", out_dir / f"{name}.key"
    status, out, err = run(
        capsys,
        "keygen",
        "instance",
        "--ca",
        ca[0],
        "--ca-key",
        ca[1],
        "--name",
        name,
        "--out-cert",
        cert,
        "--out-key",
        key,
        *extra,
    )
    assert (status, err) == (0, "")
    return cert, key, out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "version") == (0, f"version: {__version__}\n", "")


def test_keygen_ca_writes_0600_files_and_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = tmp_path / "ca.crt", tmp_path / "ca.key"
    before = datetime.now(timezone.utc).replace(microsecond=0)
    status, out, err = run(capsys, "keygen", "ca", "--out-cert", cert, "--out-key", key)
    assert (status, err) == (0, "")
    assert mode(cert) == 0o600 and mode(key) == 0o600
    assert cert.read_text().startswith("-----BEGIN CERTIFICATE-----\n")
    assert key.read_text().startswith("-----BEGIN EC PRIVATE KEY-----\n")

    m = SUMMARY.match(out)
    assert m, out
    assert m["subject"] == "CN=keyop-ca"
    assert m["fp"] == hashlib.sha256(der(cert)).hexdigest()
    start, end = parse_time(m["start"]), parse_time(m["end"])
    assert before <= start <= datetime.now(timezone.utc)
    assert end - start == timedelta(days=730)


def test_default_output_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "keygen", "ca")[0] == 0
    status, out, _ = run(
        capsys, "keygen", "instance", "--ca", "ca.crt", "--ca-key", "ca.key", "--name", "hub1"
    )
    assert status == 0 and SUMMARY.match(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ca.crt",
        "ca.key",
        "hub1.crt",
        "hub1.key",
    ]
    assert all(mode(p) == 0o600 for p in tmp_path.iterdir())


def test_refuses_to_overwrite_without_force(
    ca: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = ca
    old_cert, old_key = cert.read_bytes(), key.read_bytes()
    status, out, err = run(capsys, "keygen", "ca", "--out-cert", cert, "--out-key", key)
    assert status == 1 and out == ""
    assert err == f'Error: file "{cert}" already exists; use --force to overwrite\n'
    assert (cert.read_bytes(), key.read_bytes()) == (old_cert, old_key)

    # Only the key exists: nothing is written at all.
    other = cert.parent / "other.crt"
    status, _, err = run(capsys, "keygen", "ca", "--out-cert", other, "--out-key", key)
    assert status == 1 and err == f'Error: file "{key}" already exists; use --force to overwrite\n'
    assert not other.exists()

    os.chmod(cert, 0o644)
    status, out, err = run(capsys, "keygen", "ca", "--out-cert", cert, "--out-key", key, "--force")
    assert (status, err) == (0, "") and SUMMARY.match(out)
    assert cert.read_bytes() != old_cert and key.read_bytes() != old_key
    assert mode(cert) == 0o600 and mode(key) == 0o600


def test_instance_overwrite_needs_force(
    ca: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cert, _, _ = make_instance(capsys, ca, "hub1")
    args = ["keygen", "instance", "--ca", str(ca[0]), "--ca-key", str(ca[1]), "--name", "hub1"]
    args += ["--out-cert", str(cert), "--out-key", str(cert.with_suffix(".key"))]
    status, _, err = run(capsys, *args)
    assert status == 1
    assert err == f'Error: file "{cert}" already exists; use --force to overwrite\n'
    assert run(capsys, *args, "--force")[0] == 0


def test_instance_certificate_via_inspect(
    ca: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key, out = make_instance(capsys, ca, "10.0.0.7", "--san", "hub.local", "--san", "::1")
    assert mode(cert) == 0o600 and mode(key) == 0o600
    m = SUMMARY.match(out)
    assert m and m["subject"] == "CN=10.0.0.7"

    fields = inspect_fields(capsys, cert)
    assert fields["Subject"] == "CN=10.0.0.7"
    assert fields["Issuer"] == "CN=keyop-ca"
    assert fields["SANs"] == "DNS:10.0.0.7, IP:10.0.0.7, DNS:hub.local, IP:::1"
    assert fields["Key"] == "ECDSA P-384"
    assert fields["CA"] == "no"
    assert fields["Fingerprint"] == f"SHA-256:{m['fp']}"
    assert (fields["Valid from"], fields["Valid until"]) == (m["start"], m["end"])

    ca_fields = inspect_fields(capsys, ca[0])
    assert ca_fields["Subject"] == ca_fields["Issuer"] == "CN=keyop-ca"
    assert (ca_fields["CA"], ca_fields["SANs"]) == ("yes", "(none)")


def test_instance_certificate_with_cryptography(
    ca: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    cert_path, key_path, _ = make_instance(capsys, ca, "hub1.example.net", "--san", "10.1.1.1")
    ca_cert = x509.load_pem_x509_certificate(ca[0].read_bytes())
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())

    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert [a.value for a in cn] == ["hub1.example.net"]
    assert cert.issuer == ca_cert.subject
    assert ca_cert.subject.rfc4514_string() == "CN=keyop-ca"
    cert.verify_directly_issued_by(ca_cert)
    assert isinstance(cert.signature_hash_algorithm, hashes.SHA384)

    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["hub1.example.net"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.1.1.1"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.BasicConstraints)

    bc = ca_cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length is None
    ca_ku = ca_cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ca_ku.key_cert_sign and ca_ku.crl_sign and not ca_ku.digital_signature

    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.curve.name == "secp384r1"
    assert key.public_key() == cert.public_key()
    ca_key = serialization.load_pem_private_key(ca[1].read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    assert ca_key.curve.name == "secp384r1"


@pytest.mark.parametrize("days", [1, 10])
def test_days_are_honoured(
    ca: tuple[Path, Path], capsys: pytest.CaptureFixture[str], days: int
) -> None:
    _, _, out = make_instance(capsys, ca, f"d{days}", "--days", str(days))
    m = SUMMARY.match(out)
    assert m
    assert parse_time(m["end"]) - parse_time(m["start"]) == timedelta(days=days)


def test_missing_required_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "keygen", "instance", "--name", "x")
    assert (status, out) == (1, "")
    assert err == 'Error: required flag(s) "ca", "ca-key" not set\n'
    status, _, err = run(capsys, "keygen", "instance")
    assert err == 'Error: required flag(s) "ca", "ca-key", "name" not set\n'
    status, _, err = run(capsys, "keygen", "ca", "--days", "soon")
    assert status == 1 and err.startswith("Error: ") and "--days" in err


def test_bad_inputs_are_reported_without_traceback(
    ca: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    leaf_cert, leaf_key, _ = make_instance(capsys, ca, "leaf")
    missing = tmp_path / "missing.crt"
    cases: dict[str, list[str | Path]] = {
        "cannot read": ["--ca", missing, "--ca-key", ca[1]],
        "not a CA certificate": ["--ca", leaf_cert, "--ca-key", leaf_key],
        "does not match the public key": ["--ca", ca[0], "--ca-key", leaf_key],
        "no PEM private key block": ["--ca", ca[0], "--ca-key", ca[0]],
    }
    for expected, flags in cases.items():
        status, out, err = run(capsys, "keygen", "instance", *flags, "--name", "x")
        assert (status, out) == (1, ""), expected
        assert err.startswith("Error: ") and expected in err and err.count("\n") == 1, err
    assert not (Path.cwd() / "x.crt").exists()

    status, _, err = run(capsys, "keygen", "inspect", ca[1])
    assert status == 1 and "no PEM CERTIFICATE block" in err


def test_subprocess(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "keyop_messenger.cli", "keygen", "ca"]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert SUMMARY.match(first.stdout) and first.stderr == ""
    assert mode(tmp_path / "ca.crt") == 0o600 and mode(tmp_path / "ca.key") == 0o600
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr == 'Error: file "ca.crt" already exists; use --force to overwrite\n'


def test_python_dash_m_package(tmp_path: Path) -> None:
    """``python -m keyop_messenger`` runs the same command as ``keyop-messenger``."""
    cmd = [sys.executable, "-m", "keyop_messenger", "keygen", "ca"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert SUMMARY.match(done.stdout) and done.stderr == ""
    version = subprocess.run(
        [sys.executable, "-m", "keyop_messenger", "version"],
        capture_output=True, text=True, timeout=60,
    )
    assert (version.returncode, version.stdout) == (0, f"version: {__version__}\n")


def test_a_name_no_hub_can_allow_is_written_with_a_warning(
    ca: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """1.4 takes any --name, and so does this command; but a name outside the
    peer-name rule cannot be listed in hub.allowed_peers: say so at once."""
    out_dir = ca[0].parent
    status, out, err = run(
        capsys, "keygen", "instance", "--ca", ca[0], "--ca-key", ca[1], "--name", "bad name",
        "--out-cert", out_dir / "bad.crt", "--out-key", out_dir / "bad.key",
    )  # fmt: skip
    assert status == 0 and out.startswith("Subject:     CN=bad name\n")
    assert err.startswith("warning: invalid peer name \"bad name\": contains ' '"), err
    assert "hub.allowed_peers" in err and err.count("\n") == 1


def test_summary_into_a_closed_pipe_is_not_an_error(tmp_path: Path) -> None:
    """``keygen inspect ca.crt | head -1``: the reader leaving early is fine."""
    cmd = [sys.executable, "-m", "keyop_messenger.cli", "keygen"]
    made = subprocess.run([*cmd, "ca"], cwd=tmp_path, capture_output=True, timeout=60)
    assert made.returncode == 0, made.stderr
    shell = f"{' '.join(cmd)} inspect ca.crt | head -c 1 >/dev/null; echo ${{PIPESTATUS[0]}}"
    done = subprocess.run(
        ["bash", "-c", shell], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert (done.stdout, done.stderr) == ("0\n", ""), done
