"""Certificates and keys a messenger refuses when federation opens, and the
dates ``keygen`` and the expiry warning show (client-API issue, item 7).

A certificate outside its validity window, an encrypted private key, and a
private key that group or others can read are refused with a
:class:`FederationError` saying what is wrong (dates in ISO 8601) and what to
do. Test certificates come from the project's ``keygen`` (``fed_helpers.pki``)
or, for validity windows ``keygen`` refuses to make, from ``cryptography``.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import fed_helpers
from fed_helpers import PKI, CertPair, client_config, hub_config, peer
from keyop_messenger import Config, EphemeralMessenger, FederationError, Messenger
from keyop_messenger.cli import main

pki = fed_helpers.pki
start = fed_helpers.start

NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
#: A Unix time in seconds (ten digits) standing alone: what the messages must not
#: show. Not inside a hex run: a serial or fingerprint holds ten decimal digits in a
#: row about one time in twenty.
UNIX_SECONDS = re.compile(r"(?<![0-9a-fA-F-])\d{10}(?![0-9a-fA-F])")


def iso(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_key(path: Path, key: ec.EllipticCurvePrivateKey, mode: int = 0o600) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    os.chmod(path, mode)


def issue(
    out: Path,
    cn: str,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    *,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
    ca: bool = False,
) -> tuple[CertPair, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A P-384 certificate for ``cn`` valid from ``not_before`` to
    ``not_after``, signed by ``issuer`` (self-signed without one)."""
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    issuer_name, signer = (issuer[0].subject, issuer[1]) if issuer else (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
    )
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(cn), x509.DNSName("localhost")]), False
        )
    cert = builder.sign(signer, hashes.SHA384())
    out.mkdir(parents=True, exist_ok=True)
    pair = CertPair(out / f"{cn}.crt", out / f"{cn}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key(pair.key, key)
    return pair, cert, key


def pki_ca(pki: PKI) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    return ca_cert, ca_key


def tls(pair: CertPair, ca: Path) -> dict[str, str]:
    return {"cert": str(pair.cert), "key": str(pair.key), "ca": str(ca)}


def hub_cfg(pki: PKI, tmp_path: Path, tls_: dict[str, str]) -> Config:
    return hub_config(pki, tmp_path / "hub", [peer("node1")], tls=tls_)


def client_cfg(pki: PKI, tmp_path: Path, tls_: dict[str, str]) -> Config:
    base = client_config(pki, tmp_path / "client", "node1", 1, subscribe=["temps"])
    return Config.from_dict({**base.to_dict(), "tls": tls_})


def open_hub(cfg: Config) -> None:
    Messenger(cfg).close()


def open_client(cfg: Config) -> None:
    Messenger(cfg).close()


def open_ephemeral(cfg: Config) -> None:
    EphemeralMessenger(cfg).close()


ROLES: dict[str, tuple[Callable[..., Config], Callable[[Config], None]]] = {
    "hub": (hub_cfg, open_hub),
    "client": (client_cfg, open_client),
    "ephemeral": (client_cfg, open_ephemeral),
}


def refusal(pki: PKI, tmp_path: Path, role: str, tls_: dict[str, str]) -> str:
    make, open_ = ROLES[role]
    cfg = make(pki, tmp_path, tls_)
    with pytest.raises(FederationError) as err:
        open_(cfg)
    return str(err.value)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_expired_certificate_is_refused_with_iso_dates(
    pki: PKI, tmp_path: Path, role: str
) -> None:
    nb, na = NOW - 10 * DAY, NOW - DAY
    pair, _, _ = issue(tmp_path / "certs", "node1", nb, na, issuer=pki_ca(pki))
    msg = refusal(pki, tmp_path, role, tls(pair, pki.ca))
    assert "has expired" in msg and str(pair.cert) in msg, msg
    assert f"valid from {iso(nb)} until {iso(na)}" in msg, msg
    assert not UNIX_SECONDS.search(msg), msg
    assert "keygen instance" in msg, msg


@pytest.mark.parametrize("role", sorted(ROLES))
def test_not_yet_valid_certificate_is_refused_with_iso_dates(
    pki: PKI, tmp_path: Path, role: str
) -> None:
    nb, na = NOW + DAY, NOW + 10 * DAY
    pair, _, _ = issue(tmp_path / "certs", "node1", nb, na, issuer=pki_ca(pki))
    msg = refusal(pki, tmp_path, role, tls(pair, pki.ca))
    assert "is not yet valid" in msg and str(pair.cert) in msg, msg
    assert f"valid from {iso(nb)} until {iso(na)}" in msg, msg
    assert re.search(f"now is {ISO}", msg), msg
    assert not UNIX_SECONDS.search(msg), msg


def test_current_certificate_of_the_same_shape_opens(pki: PKI, tmp_path: Path) -> None:
    """Control for the two tests above: only the validity window differs."""
    pair, _, _ = issue(tmp_path / "certs", "node1", NOW - DAY, NOW + 40 * DAY, issuer=pki_ca(pki))
    for role, (make, open_) in ROLES.items():
        open_(make(pki, tmp_path / role, tls(pair, pki.ca)))


def test_expired_ca_certificate_is_refused(pki: PKI, tmp_path: Path) -> None:
    ca_pair, ca_cert, ca_key = issue(
        tmp_path / "ca", "old-ca", NOW - 400 * DAY, NOW - DAY, ca=True
    )
    leaf, _, _ = issue(tmp_path / "certs", "node1", NOW - DAY, NOW + DAY, issuer=(ca_cert, ca_key))
    msg = refusal(pki, tmp_path, "client", tls(leaf, ca_pair.cert))
    assert "CA certificate in tls.ca" in msg and "has expired" in msg, msg
    assert f"until {iso(NOW - DAY)}" in msg and "keygen ca" in msg, msg


@pytest.mark.parametrize("fmt", ["pkcs8", "traditional"])
@pytest.mark.parametrize("role", sorted(ROLES))
def test_encrypted_key_is_refused_with_how_to_decrypt(
    pki: PKI, tmp_path: Path, role: str, fmt: str
) -> None:
    good = pki["hub1" if role == "hub" else "node1"]
    key = serialization.load_pem_private_key(good.key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8
            if fmt == "pkcs8"
            else serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.BestAvailableEncryption(b"secret passphrase"),
        )
    )
    os.chmod(encrypted, 0o600)
    msg = refusal(pki, tmp_path, role, tls(CertPair(good.cert, encrypted), pki.ca))
    assert "is encrypted" in msg and "not supported" in msg, msg
    assert f"openssl pkey -in {encrypted}" in msg, msg


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
@pytest.mark.parametrize("role", sorted(ROLES))
def test_key_accessible_by_group_or_others_is_refused(
    pki: PKI, tmp_path: Path, role: str, mode: int
) -> None:
    good = pki["hub1" if role == "hub" else "node1"]
    loose = tmp_path / "loose.key"
    loose.write_bytes(good.key.read_bytes())
    os.chmod(loose, mode)
    msg = refusal(pki, tmp_path, role, tls(CertPair(good.cert, loose), pki.ca))
    assert f"chmod 600 {loose}" in msg and f"mode {mode:04o}" in msg, msg
    os.chmod(loose, 0o600)
    make, open_ = ROLES[role]
    open_(make(pki, tmp_path / "ok", tls(CertPair(good.cert, loose), pki.ca)))


# -- keygen -------------------------------------------------------------------


@pytest.mark.parametrize("days", ["0", "-1", "-730"])
def test_keygen_refuses_days_below_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], days: str, pki: PKI
) -> None:
    ca_out = [f"--out-cert={tmp_path / 'ca.crt'}", f"--out-key={tmp_path / 'ca.key'}"]
    assert main(["keygen", "ca", *ca_out, "--days", days]) == 1
    _, err = capsys.readouterr()
    assert err.startswith("Error: --days must be at least 1, got "), err
    inst = [
        "keygen", "instance", "--ca", str(pki.ca), "--ca-key", str(pki.ca_key), "--name", "n",
        "--out-cert", str(tmp_path / "n.crt"), "--out-key", str(tmp_path / "n.key"),
    ]  # fmt: skip
    assert main([*inst, "--days", days]) == 1
    _, err = capsys.readouterr()
    assert "--days must be at least 1" in err, err
    assert list(tmp_path.iterdir()) == [], "nothing is written"


def test_keygen_writes_keys_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        assert main(["keygen", "ca", "--out-cert", str(tmp_path / "ca.crt"),
                     "--out-key", str(tmp_path / "ca.key"), "--days", "1"]) == 0  # fmt: skip
    finally:
        os.umask(old)
    for name in ("ca.crt", "ca.key"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name


def test_keygen_inspect_prints_iso_dates(
    pki: PKI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nb, na = NOW - 10 * DAY, NOW - DAY
    pair, _, _ = issue(tmp_path, "node1", nb, na, issuer=pki_ca(pki))
    assert main(["keygen", "inspect", str(pair.cert)]) == 0
    out, _ = capsys.readouterr()
    assert f"Valid from:  {iso(nb)}\n" in out and f"Valid until: {iso(na)}\n" in out, out
    assert not UNIX_SECONDS.search(out), out


# -- expiry warning -----------------------------------------------------------


def test_expiry_warning_gives_iso_date(
    pki: PKI, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    na = NOW + 5 * DAY
    pair, _, _ = issue(tmp_path / "certs", "node1", NOW - DAY, na, issuer=pki_ca(pki))
    caplog.set_level(logging.WARNING)
    open_client(client_cfg(pki, tmp_path, tls(pair, pki.ca)))
    warnings = [r.getMessage() for r in caplog.records if "expires within" in r.getMessage()]
    assert warnings, [r.getMessage() for r in caplog.records]
    (instance,) = [w for w in warnings if w.startswith("instance")]
    assert instance == (
        f"instance certificate {pair.cert} (CN=node1) expires within 30 days, on {iso(na)} "
        "(not after); make a new one with keyop-messenger keygen"
    )
    assert not UNIX_SECONDS.search(instance), instance
