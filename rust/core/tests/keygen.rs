//! Integration tests of `keyop_core::keygen` against the certificate
//! contract of keyop-messenger 1.4 (`shared/spec/cli.md` §2-§4).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use keyop_core::keygen::{
    self, CertSummary, CertificateAuthority, InstanceRequest, KeygenError, DEFAULT_DAYS,
};
use tempfile::TempDir;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::pem::Pem;
use x509_parser::prelude::{FromDer, X509Certificate};

const OID_ECDSA_SHA384: &str = "1.2.840.10045.4.3.3";
const OID_ECDSA_SHA256: &str = "1.2.840.10045.4.3.2";
const OID_P384: &str = "1.3.132.0.34";
const DAY: i64 = 86_400;

fn tempdir() -> TempDir {
    tempfile::tempdir().expect("create temp dir")
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// The first PEM block of `path`: (label, DER).
fn pem_block(path: &Path) -> (String, Vec<u8>) {
    let data = fs::read(path).unwrap();
    let pem = Pem::iter_from_buffer(&data)
        .next()
        .expect("a PEM block")
        .unwrap();
    (pem.label, pem.contents)
}

fn cert_der(path: &Path) -> Vec<u8> {
    let (label, der) = pem_block(path);
    assert_eq!(label, "CERTIFICATE");
    der
}

fn parse(der: &[u8]) -> X509Certificate<'_> {
    let (rest, cert) = X509Certificate::from_der(der).expect("valid certificate");
    assert!(rest.is_empty());
    cert
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}

struct Ca {
    dir: TempDir,
    cert: PathBuf,
    key: PathBuf,
}

fn make_ca(days: i64) -> Ca {
    let dir = tempdir();
    let cert = dir.path().join("ca.crt");
    let key = dir.path().join("ca.key");
    keygen::keygen_ca(&cert, &key, days, false).expect("keygen ca");
    Ca { dir, cert, key }
}

fn instance(ca: &Ca, name: &str) -> InstanceRequest {
    let mut req = InstanceRequest::new(&ca.cert, &ca.key, name);
    req.out_cert = Some(ca.dir.path().join(format!("{name}.crt")));
    req.out_key = Some(ca.dir.path().join(format!("{name}.key")));
    req
}

fn sans(cert: &X509Certificate<'_>) -> Vec<String> {
    let ext = cert
        .subject_alternative_name()
        .unwrap()
        .expect("SAN extension");
    ext.value
        .general_names
        .iter()
        .map(|g| match g {
            GeneralName::DNSName(d) => format!("DNS:{d}"),
            GeneralName::IPAddress(b) => format!("IP:{b:?}"),
            other => format!("{other:?}"),
        })
        .collect()
}

/// The SEC 1 key in `path` is a P-384 key whose public half is `cert`'s.
fn assert_sec1_p384_key_of(path: &Path, cert: &X509Certificate<'_>) {
    let (label, der) = pem_block(path);
    assert_eq!(label, "EC PRIVATE KEY");
    let point = cert.public_key().subject_public_key.data.as_ref();
    assert_eq!(point.len(), 97, "uncompressed P-384 point");
    // ECPrivateKey { 1, privateKey[48], [0] secp384r1, [1] BIT STRING point }
    let curve_oid = [0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22];
    assert_eq!(&der[..4], &[0x30, 0x81, 0xa4, 0x02]);
    assert_eq!(
        &der[4..8],
        &[0x01, 0x01, 0x04, 0x30],
        "version 1, 48-byte private key"
    );
    assert_eq!(&der[56..58], &[0xa0, 0x07]);
    assert_eq!(&der[58..65], &curve_oid);
    assert_eq!(&der[65..70], &[0xa1, 0x64, 0x03, 0x62, 0x00]);
    assert_eq!(&der[70..], point);
}

#[test]
fn ca_certificate_matches_the_contract() {
    let before = now();
    let ca = make_ca(DEFAULT_DAYS);
    let der = cert_der(&ca.cert);
    let cert = parse(&der);

    assert_eq!(cert.version().0, 2, "X.509 v3");
    assert_eq!(cert.subject().to_string(), "CN=keyop-ca");
    assert_eq!(cert.issuer().as_raw(), cert.subject().as_raw());
    assert!(cert.raw_serial().len() <= 17, "serial below 2^128");
    assert_eq!(
        cert.signature_algorithm.algorithm.to_id_string(),
        OID_ECDSA_SHA384
    );
    cert.verify_signature(None).expect("self-signed");

    let nb = cert.validity().not_before.timestamp();
    let na = cert.validity().not_after.timestamp();
    assert!(nb >= before && nb <= now(), "not before is now");
    assert_eq!(na - nb, DEFAULT_DAYS * DAY);

    let bc = cert
        .basic_constraints()
        .unwrap()
        .expect("basic constraints");
    assert!(bc.critical && bc.value.ca && bc.value.path_len_constraint.is_none());
    let ku = cert.key_usage().unwrap().expect("key usage");
    assert!(ku.critical);
    assert!(ku.value.key_cert_sign() && ku.value.crl_sign());
    assert!(!ku.value.digital_signature());
    assert!(cert.extended_key_usage().unwrap().is_none());
    assert!(cert.iter_extensions().any(|e| matches!(
        e.parsed_extension(),
        ParsedExtension::SubjectKeyIdentifier(_)
    )));

    let params = cert.public_key().algorithm.parameters.as_ref().unwrap();
    assert_eq!(params.as_oid().unwrap().to_id_string(), OID_P384);
    assert_sec1_p384_key_of(&ca.key, &cert);
}

#[test]
fn key_and_certificate_files_are_0600() {
    let ca = make_ca(30);
    assert_eq!(mode(&ca.cert), 0o600);
    assert_eq!(mode(&ca.key), 0o600);
    let req = instance(&ca, "hub1");
    keygen::keygen_instance(&req).unwrap();
    assert_eq!(mode(&req.cert_path()), 0o600);
    assert_eq!(mode(&req.key_path()), 0o600);
}

#[test]
fn instance_certificate_chains_to_the_ca() {
    let ca = make_ca(DEFAULT_DAYS);
    let ca_der = cert_der(&ca.cert);
    let ca_cert = parse(&ca_der);
    let req = instance(&ca, "hub1.example.net");
    let summary = keygen::keygen_instance(&req).unwrap();
    let der = cert_der(&req.cert_path());
    let cert = parse(&der);

    assert_eq!(cert.subject().to_string(), "CN=hub1.example.net");
    assert_eq!(cert.issuer().as_raw(), ca_cert.subject().as_raw());
    cert.verify_signature(Some(ca_cert.public_key()))
        .expect("signed by the CA");
    assert!(cert.verify_signature(None).is_err(), "not self-signed");
    assert_eq!(
        cert.signature_algorithm.algorithm.to_id_string(),
        OID_ECDSA_SHA384
    );

    assert!(!cert.is_ca());
    assert!(cert.basic_constraints().unwrap().is_none());
    let ku = cert.key_usage().unwrap().unwrap();
    assert!(ku.critical && ku.value.digital_signature() && !ku.value.key_cert_sign());
    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.server_auth && eku.client_auth && !eku.any && eku.other.is_empty());
    assert_eq!(sans(&cert), ["DNS:hub1.example.net"]);

    let ski = ca_cert
        .iter_extensions()
        .find_map(|e| match e.parsed_extension() {
            ParsedExtension::SubjectKeyIdentifier(k) => Some(k.0.to_vec()),
            _ => None,
        })
        .unwrap();
    let aki = cert
        .iter_extensions()
        .find_map(|e| match e.parsed_extension() {
            ParsedExtension::AuthorityKeyIdentifier(a) => {
                a.key_identifier.as_ref().map(|k| k.0.to_vec())
            }
            _ => None,
        })
        .expect("authority key identifier");
    assert_eq!(aki, ski);
    assert!(!cert.iter_extensions().any(|e| matches!(
        e.parsed_extension(),
        ParsedExtension::SubjectKeyIdentifier(_)
    )));

    assert_sec1_p384_key_of(&req.key_path(), &cert);
    assert_eq!(summary.subject, "CN=hub1.example.net");
    assert_eq!(summary.issuer, "CN=keyop-ca");
    assert_eq!(summary.sans, ["DNS:hub1.example.net"]);
    assert_eq!(summary.key_type, "ECDSA P-384");
    assert!(!summary.is_ca);
}

#[test]
fn ip_names_and_extra_sans() {
    let ca = make_ca(30);
    let mut req = instance(&ca, "10.0.0.5");
    req.extra_sans = vec!["localhost".into(), "IP:::1".into(), "hub1".into()];
    keygen::keygen_instance(&req).unwrap();
    let der = cert_der(&req.cert_path());
    let cert = parse(&der);
    assert_eq!(cert.subject().to_string(), "CN=10.0.0.5");
    assert_eq!(
        sans(&cert),
        [
            "DNS:10.0.0.5",
            "IP:[10, 0, 0, 5]",
            "DNS:localhost",
            "IP:[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]",
            "DNS:hub1",
        ]
    );
    let summary = keygen::inspect(&req.cert_path()).unwrap().remove(0);
    assert_eq!(
        summary.sans,
        [
            "DNS:10.0.0.5",
            "IP:10.0.0.5",
            "DNS:localhost",
            "IP:::1",
            "DNS:hub1"
        ]
    );

    let mut req = instance(&ca, "hub2:7740");
    req.out_cert = Some(ca.dir.path().join("hub2.crt"));
    req.out_key = Some(ca.dir.path().join("hub2.key"));
    let summary = keygen::keygen_instance(&req).unwrap();
    assert_eq!(summary.subject, "CN=hub2:7740");
    assert_eq!(summary.sans, ["DNS:hub2:7740", "DNS:hub2"]);
}

#[test]
fn refuses_to_overwrite_without_force() {
    let ca = make_ca(30);
    let cert_before = fs::read(&ca.cert).unwrap();
    let key_before = fs::read(&ca.key).unwrap();

    let err = keygen::keygen_ca(&ca.cert, &ca.key, 30, false).unwrap_err();
    assert!(err.is_io());
    assert_eq!(
        err.to_string(),
        format!(
            "file {:?} already exists; use --force to overwrite",
            ca.cert.display().to_string()
        )
    );
    assert_eq!(fs::read(&ca.cert).unwrap(), cert_before);
    assert_eq!(fs::read(&ca.key).unwrap(), key_before);

    // Only the key exists: nothing is written, not even the certificate.
    let fresh = ca.dir.path().join("other.crt");
    let err = keygen::keygen_ca(&fresh, &ca.key, 30, false).unwrap_err();
    assert!(
        matches!(err, KeygenError::Exists { ref path } if path == &ca.key.display().to_string())
    );
    assert!(!fresh.exists());

    // Same for an instance.
    let req = instance(&ca, "hub1");
    keygen::keygen_instance(&req).unwrap();
    let err = keygen::keygen_instance(&req).unwrap_err();
    assert!(matches!(err, KeygenError::Exists { .. }), "{err}");

    // With force, both files are replaced and end up 0600.
    fs::set_permissions(&ca.cert, fs::Permissions::from_mode(0o644)).unwrap();
    keygen::keygen_ca(&ca.cert, &ca.key, 30, true).unwrap();
    assert_ne!(fs::read(&ca.cert).unwrap(), cert_before);
    assert_ne!(fs::read(&ca.key).unwrap(), key_before);
    assert_eq!(mode(&ca.cert), 0o600);
    assert_eq!(mode(&ca.key), 0o600);
    let mut forced = req.clone();
    forced.force = true;
    keygen::keygen_instance(&forced).unwrap();

    let err = keygen::keygen_ca(&ca.cert, &ca.cert, 30, true).unwrap_err();
    assert!(matches!(err, KeygenError::SamePath { .. }), "{err}");
}

#[test]
fn days_are_honoured() {
    let ca = make_ca(1);
    for days in [1, 10, 40_000] {
        let mut req = instance(&ca, &format!("d{days}"));
        req.days = days;
        let s = keygen::keygen_instance(&req).unwrap();
        assert_eq!(s.not_after - s.not_before, days * DAY, "days={days}");
        let cert_der = cert_der(&req.cert_path());
        let c = parse(&cert_der);
        assert_eq!(c.validity().not_after.timestamp(), s.not_after);
        assert!((s.not_before - now()).abs() <= 5);
    }
    for days in [0, -3] {
        let mut req = instance(&ca, &format!("d{days}"));
        req.days = days;
        let err = keygen::keygen_instance(&req).unwrap_err();
        assert!(matches!(err, KeygenError::TooFewDays { .. }), "{err}");
        assert!(
            err.to_string().contains("--days must be at least 1"),
            "{err}"
        );
        assert!(!req.cert_path().exists() && !req.key_path().exists());
        let dir = tempfile::tempdir().unwrap();
        let (c, k) = (dir.path().join("c.crt"), dir.path().join("c.key"));
        let err = keygen::keygen_ca(&c, &k, days, false).unwrap_err();
        assert!(matches!(err, KeygenError::TooFewDays { .. }), "{err}");
        assert!(!c.exists() && !k.exists());
    }
    let mut req = instance(&ca, "too-long");
    req.days = 5_000_000;
    let err = keygen::keygen_instance(&req).unwrap_err();
    assert_eq!(
        err.to_string(),
        "a validity of 5000000 days is out of range"
    );
    assert!(!req.cert_path().exists());
}

#[test]
fn summary_lines_and_inspect() {
    let ca = make_ca(30);
    let der = cert_der(&ca.cert);
    let summary = keygen::inspect(&ca.cert).unwrap().remove(0);
    let fp: String = ring::digest::digest(&ring::digest::SHA256, &der)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(summary.fingerprint_sha256, fp);
    let text = summary.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[0], "Subject:     CN=keyop-ca");
    assert!(lines[1].starts_with("Valid from:  20") && lines[1].ends_with('Z'));
    assert!(lines[2].starts_with("Valid until: 20") && lines[2].ends_with('Z'));
    assert_eq!(lines[3], format!("Fingerprint: SHA-256:{fp}"));
    for line in &lines {
        assert_ne!(
            line.as_bytes()[13],
            b' ',
            "values start in column 14: {line:?}"
        );
    }
    assert_eq!(lines[1].len(), "Valid from:  2026-03-31T14:22:01Z".len());

    let details = summary.details();
    assert!(
        details.contains("\nIssuer:      CN=keyop-ca\n"),
        "{details}"
    );
    assert!(
        details.contains("\nKey:         ECDSA P-384\n"),
        "{details}"
    );
    assert!(details.contains("\nCA:          yes\n"), "{details}");
    assert!(details.ends_with("\nSANs:        (none)"), "{details}");
    assert!(
        details.contains("\nStatus:      valid (expires in "),
        "{details}"
    );
    let at = |now: i64| summary.status_at(now);
    assert_eq!(at(summary.not_after + 3 * 86_400 + 5), "EXPIRED 3 days ago");
    assert_eq!(at(summary.not_after + 10), "EXPIRED less than a day ago");
    assert_eq!(
        at(summary.not_before - 86_400),
        "NOT YET VALID (valid in 1 day)"
    );
    assert!(
        summary
            .details_at(summary.not_after + 86_400)
            .contains("\nStatus:      EXPIRED 1 day ago\n"),
        "an expired certificate says so"
    );

    // DER input and multi-certificate PEM files.
    let der_path = ca.dir.path().join("ca.der");
    fs::write(&der_path, &der).unwrap();
    assert_eq!(keygen::inspect(&der_path).unwrap(), vec![summary.clone()]);
    let req = instance(&ca, "hub1");
    let leaf = keygen::keygen_instance(&req).unwrap();
    let bundle = ca.dir.path().join("bundle.pem");
    let text = format!(
        "junk\n{}{}",
        fs::read_to_string(req.cert_path()).unwrap(),
        fs::read_to_string(&ca.cert).unwrap()
    );
    fs::write(&bundle, text).unwrap();
    assert_eq!(keygen::inspect(&bundle).unwrap(), vec![leaf, summary]);

    let err = keygen::inspect(&ca.key).unwrap_err();
    assert!(
        err.to_string()
            .contains("no PEM CERTIFICATE block (found EC PRIVATE KEY)"),
        "{err}"
    );
    let err = keygen::inspect(&ca.dir.path().join("missing.crt")).unwrap_err();
    assert!(
        matches!(err, KeygenError::Read { .. }) && err.is_io(),
        "{err}"
    );
}

#[test]
fn ca_loading_errors() {
    let ca = make_ca(30);
    let other = make_ca(30);
    let req = instance(&ca, "leaf");
    keygen::keygen_instance(&req).unwrap();

    let missing = ca.dir.path().join("nope.crt");
    let err = CertificateAuthority::load(&missing, &ca.key).unwrap_err();
    assert!(matches!(err, KeygenError::Read { .. }), "{err}");
    assert!(err.to_string().starts_with(&format!(
        "cannot read {:?}: ",
        missing.display().to_string()
    )));

    let err = CertificateAuthority::load(&req.cert_path(), &req.key_path()).unwrap_err();
    assert!(matches!(err, KeygenError::NotCa { .. }), "{err}");

    let err = CertificateAuthority::load(&ca.cert, &other.key).unwrap_err();
    assert!(matches!(err, KeygenError::KeyMismatch { .. }), "{err}");

    let err = CertificateAuthority::load(&ca.key, &ca.key).unwrap_err();
    assert!(matches!(err, KeygenError::BadCertificate { .. }), "{err}");
    let err = CertificateAuthority::load(&ca.cert, &ca.cert).unwrap_err();
    assert!(
        err.to_string()
            .contains("no PEM private key block (found CERTIFICATE)"),
        "{err}"
    );

    // Ed25519 and RSA keys are refused by type.
    let rng = ring::rand::SystemRandom::new();
    let ed = ring::signature::Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
    let ed_path = ca.dir.path().join("ed.key");
    fs::write(&ed_path, pem("PRIVATE KEY", ed.as_ref())).unwrap();
    let err = CertificateAuthority::load(&ca.cert, &ed_path).unwrap_err();
    assert!(matches!(err, KeygenError::WrongKeyType { .. }), "{err}");
    assert!(err.to_string().contains("found an Ed25519 key"), "{err}");
    let rsa_path = ca.dir.path().join("rsa.key");
    fs::write(&rsa_path, pem("RSA PRIVATE KEY", &[0x30, 0x00])).unwrap();
    let err = CertificateAuthority::load(&ca.cert, &rsa_path).unwrap_err();
    assert!(matches!(err, KeygenError::WrongKeyType { .. }), "{err}");

    // A SEC 1 key without its public key (`openssl ec -no_public`).
    let (_, sec1) = pem_block(&ca.key);
    let mut no_public = vec![0x30, 62];
    no_public.extend_from_slice(&sec1[3..65]);
    let no_public_path = ca.dir.path().join("nopub.key");
    fs::write(&no_public_path, pem("EC PRIVATE KEY", &no_public)).unwrap();
    let err = CertificateAuthority::load(&ca.cert, &no_public_path).unwrap_err();
    assert!(
        err.to_string().ends_with("does not include its public key"),
        "{err}"
    );

    let garbage = ca.dir.path().join("garbage.key");
    fs::write(
        &garbage,
        pem("EC PRIVATE KEY", &[0x30, 0x03, 0x02, 0x01, 0x01]),
    )
    .unwrap();
    let err = CertificateAuthority::load(&ca.cert, &garbage).unwrap_err();
    assert!(matches!(err, KeygenError::BadKey { .. }), "{err}");
}

/// A PKCS #8 CA key is accepted too, and a P-256 CA signs with SHA-256.
#[test]
fn pkcs8_and_p256_ca_keys() {
    for (alg, sig_oid) in [
        (&rcgen::PKCS_ECDSA_P384_SHA384, OID_ECDSA_SHA384),
        (&rcgen::PKCS_ECDSA_P256_SHA256, OID_ECDSA_SHA256),
    ] {
        let dir = tempdir();
        let key = rcgen::KeyPair::generate_for(alg).unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "Example, Inc.");
        let ca_cert = params.self_signed(&key).unwrap();
        let (cert_path, key_path) = (dir.path().join("ca.crt"), dir.path().join("ca.key"));
        fs::write(&cert_path, ca_cert.pem()).unwrap();
        fs::write(&key_path, key.serialize_pem()).unwrap();
        assert!(fs::read_to_string(&key_path)
            .unwrap()
            .starts_with("-----BEGIN PRIVATE KEY-----"));

        let mut req = InstanceRequest::new(&cert_path, &key_path, "hub1");
        req.out_cert = Some(dir.path().join("hub1.crt"));
        req.out_key = Some(dir.path().join("hub1.key"));
        let summary = keygen::keygen_instance(&req).unwrap();
        assert_eq!(
            summary.issuer,
            "O=Example\\, Inc.,CN=rcgen self signed cert"
        );
        let der = cert_der(&req.cert_path());
        let cert = parse(&der);
        assert_eq!(cert.signature_algorithm.algorithm.to_id_string(), sig_oid);
        let ca_der = ca_cert.der().to_vec();
        let ca_parsed = parse(&ca_der);
        assert_eq!(cert.issuer().as_raw(), ca_parsed.subject().as_raw());
        cert.verify_signature(Some(ca_parsed.public_key())).unwrap();
    }
}

/// A generated CA works in memory as well, through its SEC 1 key.
#[test]
fn in_memory_round_trip() {
    let generated = keygen::generate_ca(5).unwrap();
    assert!(generated
        .key_pem
        .starts_with("-----BEGIN EC PRIVATE KEY-----\n"));
    assert!(generated
        .cert_pem
        .starts_with("-----BEGIN CERTIFICATE-----\n"));
    assert!(!format!("{generated:?}").contains("PRIVATE"));
    let ca =
        CertificateAuthority::from_pem(generated.cert_pem.as_bytes(), generated.key_pem.as_bytes())
            .unwrap();
    assert_eq!(ca.cert_der(), generated.cert_der.as_slice());
    let leaf = ca.issue("sensor-1", &[], 5).unwrap();
    let s: CertSummary = leaf.summary().unwrap();
    assert_eq!(
        (s.subject.as_str(), s.issuer.as_str()),
        ("CN=sensor-1", "CN=keyop-ca")
    );
    let ca_cert = parse(&generated.cert_der);
    parse(&leaf.cert_der)
        .verify_signature(Some(ca_cert.public_key()))
        .unwrap();
}

fn pem(label: &str, der: &[u8]) -> String {
    use std::fmt::Write as _;
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::new();
    for c in der.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                b64.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        let _ = writeln!(out, "{}", std::str::from_utf8(line).unwrap());
    }
    let _ = writeln!(out, "-----END {label}-----");
    out
}
