// why this file is long: one concern (the certificates keygen writes and inspects, as 1.4 does)
// with its inline DER reader (mod der, ~210 lines) and unit tests (~110); mod der is the next
// split.
//! CA and instance certificates for federation, as `keyop-messenger keygen`
//! of 1.4 makes them (`shared/spec/cli.md` §2-§4).
//!
//! Every key is a fresh ECDSA key on P-384, written as a PEM `EC PRIVATE KEY`
//! block (SEC 1, with the curve and the public key) in a file of mode 0600.
//! The CA is self-signed (`CN=keyop-ca`, CA=true, key usage Certificate Sign
//! and CRL Sign); an instance certificate has `CN=<name>`, key usage Digital
//! Signature, extended key usages server and client authentication, and is
//! signed by the CA.
//!
//! One deliberate difference from 1.4 (README weak spot 39): an instance
//! certificate also carries an IP SAN when the name is an IP literal, a SAN
//! for the host part of a `host:port` name, and any extra SANs asked for, so
//! that a hub dialled by IP address or through a `host:port` name verifies.
//! The DNS SAN equal to the name is always the first SAN, as in 1.4.

use std::fmt::{self, Write as _};
use std::fs::{self, OpenOptions, Permissions};
use std::io::{self, Write as _};
use std::net::IpAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rcgen::string::{Ia5String, PrintableString};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, DnValue,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
    SignatureAlgorithm, PKCS_ECDSA_P256_SHA256, PKCS_ECDSA_P384_SHA384,
};
use ring::rand::SecureRandom as _;
use x509_parser::asn1_rs::ToDer as _;
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::pem::Pem;
use x509_parser::time::ASN1Time;
use x509_parser::x509::X509Name;

/// Default validity period of new certificates, in days (about two years).
pub const DEFAULT_DAYS: i64 = 730;
/// Subject common name of every CA made by [`generate_ca`].
pub const CA_COMMON_NAME: &str = "keyop-ca";
/// Permission bits of every file written here.
pub const FILE_MODE: u32 = 0o600;

/// Why a keygen operation failed.
#[derive(Debug, thiserror::Error)]
pub enum KeygenError {
    /// An output file exists and overwriting was not allowed.
    #[error("file {path:?} already exists; use --force to overwrite")]
    Exists { path: String },
    /// The certificate and key outputs name the same file.
    #[error("the certificate and the key cannot both be written to {path:?}")]
    SamePath { path: String },
    /// An input file is missing or unreadable.
    #[error("cannot read {path:?}: {source}")]
    Read {
        path: String,
        #[source]
        source: io::Error,
    },
    /// An output file could not be written.
    #[error("cannot write {path:?}: {source}")]
    Write {
        path: String,
        #[source]
        source: io::Error,
    },
    /// A file holds no certificate, or one that does not parse.
    #[error("{path}: {reason}")]
    BadCertificate { path: String, reason: String },
    /// A file holds no private key, or one that does not parse.
    #[error("{path}: {reason}")]
    BadKey { path: String, reason: String },
    /// The issuing certificate is not a certificate authority.
    #[error("{path}: not a CA certificate ({reason})")]
    NotCa { path: String, reason: String },
    /// The CA key is not an ECDSA P-384 (or P-256) key.
    #[error("{path}: the CA key must be an ECDSA key on P-384 (or P-256), found {found}")]
    WrongKeyType { path: String, found: String },
    /// The CA key is not the key of the CA certificate.
    #[error("CA key {key:?} does not match the public key of CA certificate {cert:?}")]
    KeyMismatch { cert: String, key: String },
    /// The instance name cannot go into a certificate.
    #[error("invalid instance name {name:?}: {reason}")]
    InvalidName { name: String, reason: String },
    /// An extra subject alternative name is malformed.
    #[error("invalid subject alternative name {san:?}: {reason}")]
    InvalidSan { san: String, reason: String },
    /// `days` puts a validity bound outside the years 1 to 9999.
    #[error("a validity of {days} days is out of range")]
    Validity { days: i64 },
    /// `days` is below 1: the certificate would be expired when written.
    #[error(
        "--days must be at least 1, got {days}: the certificate would be expired (or never valid) when written"
    )]
    TooFewDays { days: i64 },
    /// The certificate could not be built or signed.
    #[error("cannot generate the certificate: {0}")]
    Generate(String),
}

impl KeygenError {
    /// True for file-system failures (existing output, unreadable input,
    /// failed write); false for bad input material or parameters.
    pub fn is_io(&self) -> bool {
        matches!(
            self,
            KeygenError::Exists { .. } | KeygenError::Read { .. } | KeygenError::Write { .. }
        )
    }
}

fn gen_err(e: rcgen::Error) -> KeygenError {
    KeygenError::Generate(e.to_string())
}

fn show(path: &Path) -> String {
    path.display().to_string()
}

// ---------------------------------------------------------------------------
// Generated material
// ---------------------------------------------------------------------------

/// A new certificate and its private key, PEM-encoded, not yet written.
pub struct Generated {
    /// DER encoding of the certificate.
    pub cert_der: Vec<u8>,
    /// The certificate as one PEM `CERTIFICATE` block.
    pub cert_pem: String,
    /// The private key as one PEM `EC PRIVATE KEY` block (SEC 1).
    pub key_pem: String,
}

impl fmt::Debug for Generated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Generated")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

impl Generated {
    fn new(cert_der: Vec<u8>, key: &KeyPair) -> Result<Self, KeygenError> {
        let sec1 = der::pkcs8_to_sec1(&key.serialize_der()).map_err(KeygenError::Generate)?;
        Ok(Generated {
            cert_pem: pem_encode("CERTIFICATE", &cert_der),
            key_pem: pem_encode("EC PRIVATE KEY", &sec1),
            cert_der,
        })
    }

    /// The summary of the certificate.
    pub fn summary(&self) -> Result<CertSummary, KeygenError> {
        CertSummary::from_der(&self.cert_der, "generated certificate")
    }
}

fn new_p384_key() -> Result<KeyPair, KeygenError> {
    KeyPair::generate_for(&PKCS_ECDSA_P384_SHA384).map_err(gen_err)
}

/// A serial number uniformly random in [0, 2^128).
fn random_serial() -> Result<SerialNumber, KeygenError> {
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| KeygenError::Generate("the system random generator failed".into()))?;
    Ok(SerialNumber::from_slice(&bytes))
}

/// First and last second (Unix time) of validity for certificates usable
/// from now on for `days` days: now, now + days × 24 h. Unlike 1.4, `days`
/// below 1 (an already-expired certificate) is refused.
fn validity(days: i64) -> Result<(ASN1Time, ASN1Time), KeygenError> {
    if days < 1 {
        return Err(KeygenError::TooFewDays { days });
    }
    // 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z: the bounds of X.509 times.
    const MIN: i64 = -62_135_596_800;
    const MAX: i64 = 253_402_300_799;
    let out_of_range = || KeygenError::Validity { days };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let end = days
        .checked_mul(86_400)
        .and_then(|s| now.checked_add(s))
        .filter(|t| (MIN..=MAX).contains(t))
        .ok_or_else(out_of_range)?;
    let start = ASN1Time::from_timestamp(now).map_err(|_| out_of_range())?;
    let end = ASN1Time::from_timestamp(end).map_err(|_| out_of_range())?;
    Ok((start, end))
}

/// A subject of one common name, as a PrintableString when the name allows
/// (as Go writes it) and UTF8String otherwise.
fn common_name(cn: &str) -> DistinguishedName {
    let value = match PrintableString::try_from(cn) {
        Ok(p) => DnValue::PrintableString(p),
        Err(_) => DnValue::Utf8String(cn.to_owned()),
    };
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, value);
    dn
}

fn base_params(cn: &str, days: i64) -> Result<CertificateParams, KeygenError> {
    let (start, end) = validity(days)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = common_name(cn);
    params.serial_number = Some(random_serial()?);
    params.not_before = start.to_datetime();
    params.not_after = end.to_datetime();
    Ok(params)
}

/// A new self-signed CA valid for `days` days from now.
pub fn generate_ca(days: i64) -> Result<Generated, KeygenError> {
    let key = new_p384_key()?;
    let mut params = base_params(CA_COMMON_NAME, days)?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key).map_err(gen_err)?;
    Generated::new(cert.der().to_vec(), &key)
}

/// The subject alternative names of an instance certificate named `name`:
/// the DNS name `name` first (as 1.4), then an IP SAN when `name` is an IP
/// literal, or a SAN for the host of a `host:port` name, then `extra`.
/// Each extra SAN is `DNS:<name>`, `IP:<address>`, or a bare value (an IP
/// address if it parses as one, a DNS name otherwise). Duplicates are dropped.
pub fn instance_sans(name: &str, extra: &[String]) -> Result<Vec<SanType>, KeygenError> {
    let dns = Ia5String::try_from(name).map_err(|_| KeygenError::InvalidName {
        name: name.to_owned(),
        reason: "a DNS name must be ASCII".into(),
    })?;
    let mut sans = vec![SanType::DnsName(dns)];
    if let Ok(ip) = name.parse::<IpAddr>() {
        sans.push(SanType::IpAddress(ip));
    } else if let Some(host) = host_of(name) {
        sans.push(auto_san(host).expect("host part of an ASCII name is ASCII"));
    }
    for raw in extra {
        let san = parse_san(raw)?;
        if !sans.contains(&san) {
            sans.push(san);
        }
    }
    Ok(sans)
}

/// The host of a `host:port` or `[v6]:port` name, if `name` is one.
fn host_of(name: &str) -> Option<&str> {
    let (host, port) = name.rsplit_once(':')?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let host = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6,
        None if host.contains(':') => return None,
        None => host,
    };
    (!host.is_empty()).then_some(host)
}

fn auto_san(value: &str) -> Option<SanType> {
    match value.parse::<IpAddr>() {
        Ok(ip) => Some(SanType::IpAddress(ip)),
        Err(_) => Ia5String::try_from(value).ok().map(SanType::DnsName),
    }
}

fn parse_san(raw: &str) -> Result<SanType, KeygenError> {
    let bad = |reason: &str| KeygenError::InvalidSan {
        san: raw.to_owned(),
        reason: reason.to_owned(),
    };
    let (kind, value) = match raw.split_once(':') {
        Some((k, v)) if k.eq_ignore_ascii_case("dns") => (Some("dns"), v),
        Some((k, v)) if k.eq_ignore_ascii_case("ip") => (Some("ip"), v),
        _ => (None, raw),
    };
    let value = value.trim();
    if value.is_empty() {
        return Err(bad("empty name"));
    }
    match kind {
        Some("ip") => value
            .parse::<IpAddr>()
            .map(SanType::IpAddress)
            .map_err(|_| bad("not an IPv4 or IPv6 address")),
        Some(_) => Ia5String::try_from(value)
            .map(SanType::DnsName)
            .map_err(|_| bad("a DNS name must be ASCII")),
        None => auto_san(value).ok_or_else(|| bad("a DNS name must be ASCII")),
    }
}

// ---------------------------------------------------------------------------
// The CA as an issuer
// ---------------------------------------------------------------------------

/// A CA certificate with its private key, ready to sign instance
/// certificates.
pub struct CertificateAuthority {
    cert_der: Vec<u8>,
    issuer: Issuer<'static, KeyPair>,
}

impl fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("cert_der_len", &self.cert_der.len())
            .finish_non_exhaustive()
    }
}

impl CertificateAuthority {
    /// Loads the CA certificate (first `CERTIFICATE` block of `cert_path`)
    /// and its key (first private-key block of `key_path`: SEC 1 `EC PRIVATE
    /// KEY` as `keygen ca` writes it, or PKCS #8 `PRIVATE KEY`).
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Self, KeygenError> {
        let read = |p: &Path| {
            fs::read(p).map_err(|source| KeygenError::Read {
                path: show(p),
                source,
            })
        };
        let cert = read(cert_path)?;
        let key = read(key_path)?;
        Self::from_pem_labelled(&cert, &show(cert_path), &key, &show(key_path))
    }

    /// As [`load`](Self::load), from PEM text in memory.
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Self, KeygenError> {
        Self::from_pem_labelled(cert_pem, "CA certificate", key_pem, "CA key")
    }

    fn from_pem_labelled(
        cert_pem: &[u8],
        cert_label: &str,
        key_pem: &[u8],
        key_label: &str,
    ) -> Result<Self, KeygenError> {
        let cert_der = read_certificates(cert_pem, cert_label)?.swap_remove(0);
        let (_, cert) = x509_parser::parse_x509_certificate(&cert_der).map_err(|e| {
            KeygenError::BadCertificate {
                path: cert_label.to_owned(),
                reason: format!("not a valid X.509 certificate: {e}"),
            }
        })?;
        check_is_ca(&cert, cert_label)?;
        let key = load_private_key(key_pem, key_label)?;
        if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(KeygenError::KeyMismatch {
                cert: cert_label.to_owned(),
                key: key_label.to_owned(),
            });
        }
        let issuer = Issuer::from_ca_cert_der(&cert_der.as_slice().into(), key).map_err(|e| {
            KeygenError::BadCertificate {
                path: cert_label.to_owned(),
                reason: format!("its subject cannot be copied into certificates ({e})"),
            }
        })?;
        Ok(CertificateAuthority { cert_der, issuer })
    }

    /// DER encoding of the CA certificate.
    pub fn cert_der(&self) -> &[u8] {
        &self.cert_der
    }

    /// A new instance certificate for `name`, valid for `days` days from
    /// now, with the SANs of [`instance_sans`].
    pub fn issue(
        &self,
        name: &str,
        extra_sans: &[String],
        days: i64,
    ) -> Result<Generated, KeygenError> {
        let sans = instance_sans(name, extra_sans)?;
        let key = new_p384_key()?;
        let mut params = base_params(name, days)?;
        params.subject_alt_names = sans;
        params.is_ca = IsCa::NoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.issuer).map_err(gen_err)?;
        Generated::new(cert.der().to_vec(), &key)
    }
}

fn check_is_ca(cert: &X509Certificate<'_>, label: &str) -> Result<(), KeygenError> {
    let not_ca = |reason: &str| KeygenError::NotCa {
        path: label.to_owned(),
        reason: reason.to_owned(),
    };
    if !cert.is_ca() {
        return Err(not_ca("its basic constraints do not say CA=true"));
    }
    if let Ok(Some(ku)) = cert.key_usage() {
        if !ku.value.key_cert_sign() {
            return Err(not_ca("its key usage does not allow certificate signing"));
        }
    }
    Ok(())
}

/// Parses the first private-key block of `pem` into a signing key.
fn load_private_key(pem: &[u8], label: &str) -> Result<KeyPair, KeygenError> {
    let bad = |reason: String| KeygenError::BadKey {
        path: label.to_owned(),
        reason,
    };
    let wrong = |found: &str| KeygenError::WrongKeyType {
        path: label.to_owned(),
        found: found.to_owned(),
    };
    let mut seen = Vec::new();
    let mut block = None;
    for item in Pem::iter_from_buffer(pem) {
        let item = item.map_err(|e| bad(format!("malformed PEM: {e}")))?;
        match item.label.as_str() {
            "EC PRIVATE KEY" | "PRIVATE KEY" => {
                block = Some(item);
                break;
            }
            "RSA PRIVATE KEY" => return Err(wrong("an RSA key")),
            "ENCRYPTED PRIVATE KEY" => {
                return Err(bad("encrypted private keys are not supported".into()))
            }
            other => seen.push(other.to_owned()),
        }
    }
    let Some(block) = block else {
        let found = if seen.is_empty() {
            String::new()
        } else {
            format!(" (found {})", seen.join(", "))
        };
        return Err(bad(format!("no PEM private key block{found}")));
    };
    let (pkcs8, curve) = if block.label == "EC PRIVATE KEY" {
        let curve = der::sec1_curve(&block.contents).map_err(|e| bad(e.into()))?;
        (der::sec1_to_pkcs8(&block.contents, curve), curve)
    } else {
        let (alg, params) = der::pkcs8_algorithm(&block.contents).map_err(|e| bad(e.into()))?;
        if alg != der::OID_EC_PUBLIC_KEY {
            return Err(wrong(der::key_algorithm_name(alg)));
        }
        let curve = params.ok_or_else(|| bad("EC key without a named curve".into()))?;
        (block.contents.clone(), curve)
    };
    der::check_has_public_key(&pkcs8).map_err(|e| bad(e.into()))?;
    let alg: &'static SignatureAlgorithm = match curve {
        der::OID_P384 => &PKCS_ECDSA_P384_SHA384,
        der::OID_P256 => &PKCS_ECDSA_P256_SHA256,
        other => return Err(wrong(&format!("an EC key on {}", der::curve_name(other)))),
    };
    KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8.into(), alg)
        .map_err(|e| bad(format!("cannot use the private key: {e}")))
}

/// Every certificate in `data`: the `CERTIFICATE` blocks of PEM text, or
/// `data` itself when it is not PEM (DER). Never empty.
pub fn read_certificates(data: &[u8], label: &str) -> Result<Vec<Vec<u8>>, KeygenError> {
    let bad = |reason: String| KeygenError::BadCertificate {
        path: label.to_owned(),
        reason,
    };
    if !data.windows(11).any(|w| w == b"-----BEGIN ") {
        if data.first() == Some(&0x30) {
            return Ok(vec![data.to_vec()]);
        }
        return Err(bad("no PEM CERTIFICATE block".into()));
    }
    let mut certs = Vec::new();
    let mut seen = Vec::new();
    for item in Pem::iter_from_buffer(data) {
        let item = item.map_err(|e| bad(format!("malformed PEM: {e}")))?;
        if item.label == "CERTIFICATE" {
            certs.push(item.contents);
        } else {
            seen.push(item.label);
        }
    }
    if certs.is_empty() {
        let found = if seen.is_empty() {
            String::new()
        } else {
            format!(" (found {})", seen.join(", "))
        };
        return Err(bad(format!("no PEM CERTIFICATE block{found}")));
    }
    Ok(certs)
}

// ---------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------

/// Fails unless both outputs may be written: distinct paths, and, without
/// `force`, neither exists yet.
pub fn check_outputs(cert_path: &Path, key_path: &Path, force: bool) -> Result<(), KeygenError> {
    if cert_path == key_path {
        return Err(KeygenError::SamePath {
            path: show(cert_path),
        });
    }
    if !force {
        for p in [cert_path, key_path] {
            if fs::symlink_metadata(p).is_ok() {
                return Err(KeygenError::Exists { path: show(p) });
            }
        }
    }
    Ok(())
}

/// Writes the certificate, then the key, each with mode 0600. Without
/// `force` an existing file is never overwritten; with it, an existing file
/// is truncated, rewritten and set to mode 0600.
pub fn write_files(
    generated: &Generated,
    cert_path: &Path,
    key_path: &Path,
    force: bool,
) -> Result<(), KeygenError> {
    check_outputs(cert_path, key_path, force)?;
    write_private_file(cert_path, generated.cert_pem.as_bytes(), force)?;
    write_private_file(key_path, generated.key_pem.as_bytes(), force)
}

fn write_private_file(path: &Path, data: &[u8], force: bool) -> Result<(), KeygenError> {
    let werr = |source| KeygenError::Write {
        path: show(path),
        source,
    };
    let mut opts = OpenOptions::new();
    opts.write(true).mode(FILE_MODE);
    if force {
        opts.create(true).truncate(true);
    } else {
        opts.create_new(true);
    }
    let mut file = opts.open(path).map_err(|e| {
        if e.kind() == io::ErrorKind::AlreadyExists {
            KeygenError::Exists { path: show(path) }
        } else {
            werr(e)
        }
    })?;
    file.set_permissions(Permissions::from_mode(FILE_MODE))
        .map_err(werr)?;
    file.write_all(data).map_err(werr)?;
    file.sync_all().map_err(werr)
}

/// `keygen ca`: a new CA written to `out_cert` and `out_key`; returns its
/// summary.
pub fn keygen_ca(
    out_cert: &Path,
    out_key: &Path,
    days: i64,
    force: bool,
) -> Result<CertSummary, KeygenError> {
    check_outputs(out_cert, out_key, force)?;
    let generated = generate_ca(days)?;
    write_files(&generated, out_cert, out_key, force)?;
    generated.summary()
}

/// The arguments of `keygen instance`.
#[derive(Debug, Clone)]
pub struct InstanceRequest {
    /// CA certificate PEM.
    pub ca_cert: PathBuf,
    /// CA private key PEM.
    pub ca_key: PathBuf,
    /// Instance name: the subject CN and the first DNS SAN.
    pub name: String,
    /// Certificate output; `<name>.crt` when `None`.
    pub out_cert: Option<PathBuf>,
    /// Key output; `<name>.key` when `None`.
    pub out_key: Option<PathBuf>,
    /// Validity in days from now.
    pub days: i64,
    /// Overwrite existing outputs.
    pub force: bool,
    /// Extra SANs (see [`instance_sans`]).
    pub extra_sans: Vec<String>,
}

impl InstanceRequest {
    /// A request with the defaults of `keygen instance`.
    pub fn new(ca_cert: impl Into<PathBuf>, ca_key: impl Into<PathBuf>, name: &str) -> Self {
        InstanceRequest {
            ca_cert: ca_cert.into(),
            ca_key: ca_key.into(),
            name: name.to_owned(),
            out_cert: None,
            out_key: None,
            days: DEFAULT_DAYS,
            force: false,
            extra_sans: Vec::new(),
        }
    }

    /// The certificate output path.
    pub fn cert_path(&self) -> PathBuf {
        self.out_cert
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("{}.crt", self.name)))
    }

    /// The key output path.
    pub fn key_path(&self) -> PathBuf {
        self.out_key
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("{}.key", self.name)))
    }
}

/// `keygen instance`: a new instance certificate and key signed by the CA;
/// returns the certificate's summary.
pub fn keygen_instance(req: &InstanceRequest) -> Result<CertSummary, KeygenError> {
    let (cert_path, key_path) = (req.cert_path(), req.key_path());
    check_outputs(&cert_path, &key_path, req.force)?;
    let ca = CertificateAuthority::load(&req.ca_cert, &req.ca_key)?;
    let generated = ca.issue(&req.name, &req.extra_sans, req.days)?;
    write_files(&generated, &cert_path, &key_path, req.force)?;
    generated.summary()
}

/// `keygen inspect`: the summary of every certificate in the file at `path`
/// (PEM, or a single DER certificate).
pub fn inspect(path: &Path) -> Result<Vec<CertSummary>, KeygenError> {
    let label = show(path);
    let data = fs::read(path).map_err(|source| KeygenError::Read {
        path: label.clone(),
        source,
    })?;
    read_certificates(&data, &label)?
        .iter()
        .map(|der| CertSummary::from_der(der, &label))
        .collect()
}

// ---------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------

/// What `keygen` prints about a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertSummary {
    /// Subject in Go's RFC 2253 string form, e.g. `CN=hub1`.
    pub subject: String,
    /// Issuer in the same form.
    pub issuer: String,
    /// Serial number, lowercase hexadecimal.
    pub serial: String,
    /// Start of validity, Unix seconds.
    pub not_before: i64,
    /// End of validity, Unix seconds.
    pub not_after: i64,
    /// SHA-256 of the DER encoding, lowercase hexadecimal.
    pub fingerprint_sha256: String,
    /// Subject alternative names: `DNS:x`, `IP:x`, `URI:x`, `email:x`.
    pub sans: Vec<String>,
    /// Basic constraints say CA=true.
    pub is_ca: bool,
    /// Public key type, e.g. `ECDSA P-384`.
    pub key_type: String,
}

impl CertSummary {
    /// Summarises a DER certificate; `label` names it in errors.
    pub fn from_der(der: &[u8], label: &str) -> Result<Self, KeygenError> {
        let (_, cert) =
            x509_parser::parse_x509_certificate(der).map_err(|e| KeygenError::BadCertificate {
                path: label.to_owned(),
                reason: format!("not a valid X.509 certificate: {e}"),
            })?;
        let fingerprint = ring::digest::digest(&ring::digest::SHA256, der);
        let sans = match cert.subject_alternative_name() {
            Ok(Some(ext)) => ext.value.general_names.iter().map(general_name).collect(),
            _ => Vec::new(),
        };
        Ok(CertSummary {
            subject: dn_string(cert.subject()),
            issuer: dn_string(cert.issuer()),
            serial: serial_hex(cert.raw_serial()),
            not_before: cert.validity().not_before.timestamp(),
            not_after: cert.validity().not_after.timestamp(),
            fingerprint_sha256: hex(fingerprint.as_ref()),
            sans,
            is_ca: cert.is_ca(),
            key_type: key_type(&cert),
        })
    }

    /// Start of validity in RFC 3339, whole seconds, UTC.
    pub fn valid_from(&self) -> String {
        rfc3339(self.not_before)
    }

    /// End of validity in RFC 3339, whole seconds, UTC.
    pub fn valid_until(&self) -> String {
        rfc3339(self.not_after)
    }

    /// Every field, one labelled line each (the `inspect` output), with the
    /// certificate's state at this moment.
    pub fn details(&self) -> String {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        self.details_at(now)
    }

    /// Whether the certificate is valid at `now` (Unix seconds), in words:
    /// `valid (expires in 364 days)`, `EXPIRED 3 days ago`, `NOT YET VALID ...`.
    pub fn status_at(&self, now: i64) -> String {
        const DAY: i64 = 86_400;
        let days = |secs: i64| {
            let n = secs / DAY;
            if n == 1 {
                "1 day".to_owned()
            } else if n == 0 {
                "less than a day".to_owned()
            } else {
                format!("{n} days")
            }
        };
        if now < self.not_before {
            format!(
                "NOT YET VALID (valid in {})",
                days(self.not_before.saturating_sub(now))
            )
        } else if now > self.not_after {
            format!("EXPIRED {} ago", days(now.saturating_sub(self.not_after)))
        } else {
            format!(
                "valid (expires in {})",
                days(self.not_after.saturating_sub(now))
            )
        }
    }

    /// [`details`](Self::details) as seen at `now` (Unix seconds).
    pub fn details_at(&self, now: i64) -> String {
        let sans = if self.sans.is_empty() {
            "(none)".to_owned()
        } else {
            self.sans.join(", ")
        };
        let mut out = String::new();
        for (label, value) in [
            ("Subject:", self.subject.as_str()),
            ("Issuer:", &self.issuer),
            ("Serial:", &self.serial),
            ("Valid from:", &self.valid_from()),
            ("Valid until:", &self.valid_until()),
            ("Status:", &self.status_at(now)),
            (
                "Fingerprint:",
                &format!("SHA-256:{}", self.fingerprint_sha256),
            ),
            ("Key:", &self.key_type),
            ("CA:", if self.is_ca { "yes" } else { "no" }),
            ("SANs:", &sans),
        ] {
            if !out.is_empty() {
                out.push('\n');
            }
            let _ = write!(out, "{label:<13}{value}");
        }
        out
    }
}

/// The four lines `keygen` prints (cli.md §4), without a final newline.
impl fmt::Display for CertSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Subject:     {}\nValid from:  {}\nValid until: {}\nFingerprint: SHA-256:{}",
            self.subject,
            self.valid_from(),
            self.valid_until(),
            self.fingerprint_sha256
        )
    }
}

/// A Unix time as an RFC 3339 (ISO 8601) UTC date and time, `2026-01-31T12:00:00Z`.
pub(crate) fn rfc3339(secs: i64) -> String {
    match chrono::DateTime::from_timestamp(secs, 0) {
        Some(t) => t.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
        None => format!("@{secs}"),
    }
}

fn serial_hex(raw: &[u8]) -> String {
    let start = raw.iter().position(|&b| b != 0).unwrap_or(raw.len());
    if start == raw.len() {
        "0".to_owned()
    } else {
        hex(&raw[start..])
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn general_name(name: &GeneralName<'_>) -> String {
    match name {
        GeneralName::DNSName(d) => format!("DNS:{d}"),
        GeneralName::IPAddress(b) => match b.len() {
            4 => format!("IP:{}", IpAddr::from(<[u8; 4]>::try_from(*b).unwrap())),
            16 => format!("IP:{}", IpAddr::from(<[u8; 16]>::try_from(*b).unwrap())),
            _ => format!("IP:#{}", hex(b)),
        },
        GeneralName::URI(u) => format!("URI:{u}"),
        GeneralName::RFC822Name(m) => format!("email:{m}"),
        other => format!("{other:?}"),
    }
}

fn key_type(cert: &X509Certificate<'_>) -> String {
    let alg = &cert.public_key().algorithm;
    let oid = alg.algorithm.to_id_string();
    match oid.as_str() {
        "1.2.840.10045.2.1" => {
            let curve = alg
                .parameters
                .as_ref()
                .and_then(|p| p.as_oid().ok())
                .map(|o| o.to_id_string())
                .unwrap_or_default();
            format!("ECDSA {}", der::curve_name_dotted(&curve))
        }
        "1.2.840.113549.1.1.1" => match cert.public_key().parsed() {
            Ok(k) => format!("RSA {}", k.key_size()),
            Err(_) => "RSA".to_owned(),
        },
        "1.3.101.112" => "Ed25519".to_owned(),
        _ => oid,
    }
}

/// A distinguished name as Go's `pkix.RDNSequence.String` writes it: RDNs
/// in reverse order separated by `,`, multi-valued RDNs joined by `+`, RFC
/// 2253 escaping.
pub fn dn_string(name: &X509Name<'_>) -> String {
    let rdns: Vec<_> = name.iter().collect();
    let mut out = String::new();
    for (i, rdn) in rdns.iter().rev().enumerate() {
        if i > 0 {
            out.push(',');
        }
        for (j, atv) in rdn.iter().enumerate() {
            if j > 0 {
                out.push('+');
            }
            let oid = atv.attr_type().to_id_string();
            let ty = match oid.as_str() {
                "2.5.4.6" => "C",
                "2.5.4.10" => "O",
                "2.5.4.11" => "OU",
                "2.5.4.3" => "CN",
                "2.5.4.5" => "SERIALNUMBER",
                "2.5.4.7" => "L",
                "2.5.4.8" => "ST",
                "2.5.4.9" => "STREET",
                "2.5.4.17" => "POSTALCODE",
                _ => {
                    let der = atv.attr_value().to_der_vec().unwrap_or_default();
                    let _ = write!(out, "{oid}=#{}", hex(&der));
                    continue;
                }
            };
            let value = atv
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|_| String::from_utf8_lossy(atv.as_slice()).into_owned());
            out.push_str(ty);
            out.push('=');
            let last = value.chars().count().saturating_sub(1);
            for (k, c) in value.chars().enumerate() {
                let escape = match c {
                    ',' | '+' | '"' | '\\' | '<' | '>' | ';' => true,
                    ' ' => k == 0 || k == last,
                    '#' => k == 0,
                    _ => false,
                };
                if escape {
                    out.push('\\');
                }
                out.push(c);
            }
        }
    }
    out
}

/// One PEM block with 64-character lines and a final newline.
fn pem_encode(label: &str, der: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = Vec::with_capacity(der.len().div_ceil(3) * 4);
    for chunk in der.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                b64.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]);
            } else {
                b64.push(b'=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    let _ = writeln!(out, "-----END {label}-----");
    out
}

/// Just enough DER to move EC keys between PKCS #8 and SEC 1.
mod der {
    /// Content octets of the OIDs used here.
    pub const OID_EC_PUBLIC_KEY: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
    pub const OID_P256: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
    pub const OID_P384: &[u8] = &[0x2b, 0x81, 0x04, 0x00, 0x22];
    const OID_P521: &[u8] = &[0x2b, 0x81, 0x04, 0x00, 0x23];
    const OID_RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01];
    const OID_ED25519: &[u8] = &[0x2b, 0x65, 0x70];

    const SEQUENCE: u8 = 0x30;
    const INTEGER: u8 = 0x02;
    const OCTET_STRING: u8 = 0x04;
    const OID: u8 = 0x06;
    const CONTEXT_0: u8 = 0xa0;
    const CONTEXT_1: u8 = 0xa1;

    /// Splits one TLV off `input`: (tag, value, rest).
    fn read(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, rest) = input.split_first()?;
        if tag & 0x1f == 0x1f {
            return None;
        }
        let (&first, mut rest) = rest.split_first()?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            let len = rest[..n]
                .iter()
                .fold(0usize, |l, &b| (l << 8) | usize::from(b));
            rest = &rest[n..];
            len
        };
        (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
    }

    fn expect(input: &[u8], tag: u8) -> Result<(&[u8], &[u8]), &'static str> {
        match read(input) {
            Some((t, v, rest)) if t == tag => Ok((v, rest)),
            _ => Err(match tag {
                SEQUENCE => "malformed key: expected a SEQUENCE",
                INTEGER => "malformed key: expected an INTEGER",
                OCTET_STRING => "malformed key: expected an OCTET STRING",
                OID => "malformed key: expected an OBJECT IDENTIFIER",
                _ => "malformed key",
            }),
        }
    }

    fn write(tag: u8, value: &[u8], out: &mut Vec<u8>) {
        out.push(tag);
        let len = value.len();
        if len < 0x80 {
            out.push(len as u8);
        } else {
            let bytes = len.to_be_bytes();
            let skip = bytes.iter().take_while(|&&b| b == 0).count();
            out.push(0x80 | (bytes.len() - skip) as u8);
            out.extend_from_slice(&bytes[skip..]);
        }
        out.extend_from_slice(value);
    }

    fn tlv(tag: u8, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(value.len() + 6);
        write(tag, value, &mut out);
        out
    }

    /// PKCS #8 PrivateKeyInfo: (algorithm OID, parameters OID if any,
    /// privateKey octets).
    #[allow(clippy::type_complexity)]
    fn pkcs8_parts(der: &[u8]) -> Result<(&[u8], Option<&[u8]>, &[u8]), &'static str> {
        let (info, _) = expect(der, SEQUENCE)?;
        let (_version, rest) = expect(info, INTEGER)?;
        let (alg, rest) = expect(rest, SEQUENCE)?;
        let (private_key, _) = expect(rest, OCTET_STRING)?;
        let (alg_oid, params) = expect(alg, OID)?;
        let params = match read(params) {
            Some((OID, v, _)) => Some(v),
            _ => None,
        };
        Ok((alg_oid, params, private_key))
    }

    /// Algorithm and curve (EC keys) of a PKCS #8 key.
    pub fn pkcs8_algorithm(der: &[u8]) -> Result<(&[u8], Option<&[u8]>), &'static str> {
        pkcs8_parts(der).map(|(alg, params, _)| (alg, params))
    }

    /// ECPrivateKey fields: (version, privateKey, [0] curve OID, raw [1] TLV).
    #[allow(clippy::type_complexity)]
    fn sec1_parts(
        der: &[u8],
    ) -> Result<(&[u8], &[u8], Option<&[u8]>, Option<&[u8]>), &'static str> {
        let (key, _) = expect(der, SEQUENCE)?;
        let (version, rest) = expect(key, INTEGER)?;
        if version != [1u8].as_slice() {
            return Err("unsupported EC private key version");
        }
        let (private_key, mut rest) = expect(rest, OCTET_STRING)?;
        let mut curve = None;
        let mut public_key = None;
        while let Some((tag, value, next)) = read(rest) {
            match tag {
                CONTEXT_0 => curve = Some(expect(value, OID)?.0),
                CONTEXT_1 => public_key = Some(&rest[..rest.len() - next.len()]),
                _ => {}
            }
            rest = next;
        }
        Ok((version, private_key, curve, public_key))
    }

    /// The curve of a SEC 1 key (which must name it).
    pub fn sec1_curve(der: &[u8]) -> Result<&[u8], &'static str> {
        sec1_parts(der)?
            .2
            .ok_or("EC private key without a named curve")
    }

    /// Fails unless the EC key in `pkcs8` carries its public key (which ring
    /// requires, and which OpenSSL's `-no_public` leaves out).
    pub fn check_has_public_key(pkcs8: &[u8]) -> Result<(), &'static str> {
        let (_, _, inner) = pkcs8_parts(pkcs8)?;
        match sec1_parts(inner)?.3 {
            Some(_) => Ok(()),
            None => Err("the EC private key does not include its public key"),
        }
    }

    /// Wraps a SEC 1 key in PKCS #8.
    pub fn sec1_to_pkcs8(sec1: &[u8], curve: &[u8]) -> Vec<u8> {
        let mut alg = tlv(OID, OID_EC_PUBLIC_KEY);
        write(OID, curve, &mut alg);
        let mut info = tlv(INTEGER, &[0]);
        write(SEQUENCE, &alg, &mut info);
        write(OCTET_STRING, sec1, &mut info);
        tlv(SEQUENCE, &info)
    }

    /// The SEC 1 form (with the named curve and the public key, as Go's
    /// `MarshalECPrivateKey` writes it) of a PKCS #8 EC key.
    pub fn pkcs8_to_sec1(pkcs8: &[u8]) -> Result<Vec<u8>, String> {
        let (alg, params, inner) = pkcs8_parts(pkcs8)?;
        if alg != OID_EC_PUBLIC_KEY {
            return Err("not an EC key".into());
        }
        let (version, private_key, curve, public_key) = sec1_parts(inner)?;
        let curve = curve.or(params).ok_or("EC key without a named curve")?;
        let public_key = public_key.ok_or("EC key without its public key")?;
        let mut body = tlv(INTEGER, version);
        write(OCTET_STRING, private_key, &mut body);
        write(CONTEXT_0, &tlv(OID, curve), &mut body);
        body.extend_from_slice(public_key);
        Ok(tlv(SEQUENCE, &body))
    }

    /// A readable description of a key of algorithm `oid`.
    pub fn key_algorithm_name(oid: &[u8]) -> &'static str {
        match oid {
            OID_RSA => "an RSA key",
            OID_ED25519 => "an Ed25519 key",
            OID_EC_PUBLIC_KEY => "an EC key",
            _ => "a key of another algorithm",
        }
    }

    /// A readable name for a curve OID.
    pub fn curve_name(oid: &[u8]) -> &'static str {
        match oid {
            OID_P256 => "P-256",
            OID_P384 => "P-384",
            OID_P521 => "P-521",
            _ => "an unknown curve",
        }
    }

    /// A readable name for a curve OID in dotted form.
    pub fn curve_name_dotted(oid: &str) -> String {
        match oid {
            "1.2.840.10045.3.1.7" => "P-256".into(),
            "1.3.132.0.34" => "P-384".into(),
            "1.3.132.0.35" => "P-521".into(),
            other => other.into(),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn long_lengths_round_trip() {
            let value = vec![7u8; 300];
            let enc = tlv(OCTET_STRING, &value);
            assert_eq!(&enc[..4], &[OCTET_STRING, 0x82, 0x01, 0x2c]);
            let (tag, v, rest) = read(&enc).unwrap();
            assert_eq!((tag, v, rest.len()), (OCTET_STRING, &value[..], 0));
        }

        #[test]
        fn truncated_input_is_refused() {
            assert!(read(&[SEQUENCE, 0x05, 1, 2]).is_none());
            assert!(read(&[SEQUENCE, 0x85, 1, 1, 1, 1, 1]).is_none());
            assert!(sec1_curve(&[SEQUENCE, 0x00]).is_err());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn san_strings(sans: &[SanType]) -> Vec<String> {
        sans.iter()
            .map(|s| match s {
                SanType::DnsName(d) => format!("DNS:{}", d.as_str()),
                SanType::IpAddress(ip) => format!("IP:{ip}"),
                other => format!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn sans_of_plain_ip_and_host_port_names() {
        let none: &[String] = &[];
        assert_eq!(
            san_strings(&instance_sans("hub1", none).unwrap()),
            ["DNS:hub1"]
        );
        assert_eq!(
            san_strings(&instance_sans("10.0.0.5", none).unwrap()),
            ["DNS:10.0.0.5", "IP:10.0.0.5"]
        );
        assert_eq!(
            san_strings(&instance_sans("::1", none).unwrap()),
            ["DNS:::1", "IP:::1"]
        );
        assert_eq!(
            san_strings(&instance_sans("hub1.example.net:7740", none).unwrap()),
            ["DNS:hub1.example.net:7740", "DNS:hub1.example.net"]
        );
        assert_eq!(
            san_strings(&instance_sans("[fd00::2]:7740", none).unwrap()),
            ["DNS:[fd00::2]:7740", "IP:fd00::2"]
        );
        assert_eq!(
            san_strings(&instance_sans("192.168.1.9:7740", none).unwrap()),
            ["DNS:192.168.1.9:7740", "IP:192.168.1.9"]
        );
    }

    #[test]
    fn extra_sans_are_typed_and_deduplicated() {
        let extra: Vec<String> = [
            "localhost",
            "127.0.0.1",
            "DNS:hub1",
            "ip:::1",
            "dns:10.1.1.1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            san_strings(&instance_sans("hub1", &extra).unwrap()),
            [
                "DNS:hub1",
                "DNS:localhost",
                "IP:127.0.0.1",
                "IP:::1",
                "DNS:10.1.1.1"
            ]
        );
        for bad in ["", "IP:hub1", "DNS:", "héllo"] {
            let err = instance_sans("hub1", &[bad.to_string()]).unwrap_err();
            assert!(
                matches!(err, KeygenError::InvalidSan { .. }),
                "{bad}: {err}"
            );
        }
        let err = instance_sans("héllo", &[]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid instance name \"héllo\": a DNS name must be ASCII"
        );
    }

    #[test]
    fn pem_encoding_matches_base64() {
        assert_eq!(
            pem_encode("X", b"hello world!?"),
            "-----BEGIN X-----\naGVsbG8gd29ybGQhPw==\n-----END X-----\n"
        );
        let long = pem_encode("X", &[0xffu8; 100]);
        let lines: Vec<_> = long.lines().collect();
        assert_eq!(lines[1].len(), 64);
        assert_eq!(lines.len(), 5);
        let pem = Pem::iter_from_buffer(long.as_bytes())
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(pem.contents, vec![0xffu8; 100]);
    }

    #[test]
    fn validity_bounds() {
        let (a, b) = validity(1).unwrap();
        assert_eq!(b.timestamp() - a.timestamp(), 86_400);
        for days in [0, -2, i64::MIN] {
            assert!(matches!(
                validity(days),
                Err(KeygenError::TooFewDays { days: d }) if d == days
            ));
        }
        assert!(matches!(
            validity(10_000_000),
            Err(KeygenError::Validity { days: 10_000_000 })
        ));
        assert!(validity(i64::MAX).is_err());
    }
}
