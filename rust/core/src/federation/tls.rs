//! TLS for federation: rustls configurations for both roles, and the peer
//! identity (certificate subject CN).

use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig, SupportedProtocolVersion};

use super::{FedError, TlsSettings};

/// Certificates and keys loaded from the `tls` section.
pub struct TlsMaterial {
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
    versions: &'static [&'static SupportedProtocolVersion],
}

static TLS13_ONLY: &[&SupportedProtocolVersion] = &[&rustls::version::TLS13];
static TLS12_AND_13: &[&SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(what: &str, path: &str, e: impl std::fmt::Display) -> FedError {
    FedError::Tls(format!("{what} {path:?}: {e}"))
}

fn check_readable(what: &str, path: &str) -> Result<(), FedError> {
    if path.is_empty() {
        return Err(FedError::Tls(format!("tls.{what} is not set")));
    }
    std::fs::metadata(Path::new(path))
        .map(|_| ())
        .map_err(|e| tls_err(&format!("cannot read tls.{what}"), path, e))
}

impl TlsMaterial {
    /// Loads `tls.cert`, `tls.key` and `tls.ca`, checking that the key
    /// belongs to the certificate and that the certificate chains to the CA.
    pub fn load(cfg: &TlsSettings) -> Result<TlsMaterial, FedError> {
        check_readable("cert", &cfg.cert)?;
        check_readable("key", &cfg.key)?;
        check_readable("ca", &cfg.ca)?;
        check_key_file(&cfg.key)?;
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cfg.cert)
            .map_err(|e| tls_err("cannot read tls.cert", &cfg.cert, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| tls_err("bad PEM certificate in tls.cert", &cfg.cert, e))?;
        if certs.is_empty() {
            return Err(tls_err(
                "no certificate in",
                &cfg.cert,
                "expected a CERTIFICATE PEM block",
            ));
        }
        let now = unix_now();
        for (i, der) in certs.iter().enumerate() {
            let what = if i == 0 {
                "the instance certificate in tls.cert"
            } else {
                "a chain certificate in tls.cert"
            };
            check_validity(what, &cfg.cert, der, now, "keygen instance")?;
        }
        let key = PrivateKeyDer::from_pem_file(&cfg.key)
            .map_err(|e| tls_err("no usable private key in tls.key", &cfg.key, e))?;
        let mut roots = RootCertStore::empty();
        let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cfg.ca)
            .map_err(|e| tls_err("cannot read tls.ca", &cfg.ca, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| tls_err("bad PEM certificate in tls.ca", &cfg.ca, e))?;
        let issuer = issuer_of(&certs[0]);
        for ca in &cas {
            if issuer.is_some() && subject_of(ca) == issuer {
                check_validity(
                    "the CA certificate in tls.ca",
                    &cfg.ca,
                    ca,
                    now,
                    "keygen ca",
                )?;
            }
        }
        for ca in cas {
            roots
                .add(ca)
                .map_err(|e| tls_err("unusable CA certificate in tls.ca", &cfg.ca, e))?;
        }
        if roots.is_empty() {
            return Err(tls_err(
                "no CA certificate in",
                &cfg.ca,
                "expected a CERTIFICATE PEM block",
            ));
        }
        let versions = match cfg.min_version.as_str() {
            "1.2" => TLS12_AND_13,
            "" | "1.3" => TLS13_ONLY,
            other => {
                return Err(FedError::Tls(format!(
                    "tls.min_version must be \"1.2\" or \"1.3\", got {other:?}"
                )))
            }
        };
        let material = TlsMaterial {
            certs,
            key,
            roots: Arc::new(roots),
            versions,
        };
        // Building the server side checks that the key matches the certificate.
        material.server_config().map_err(|e| match e {
            rustls::Error::InconsistentKeys(_) => FedError::Tls(format!(
                "tls.key {:?} is not the key of the certificate in tls.cert {:?}: use the \
                 pair keygen instance wrote together",
                cfg.key, cfg.cert
            )),
            e => FedError::Tls(format!(
                "tls.cert {:?} and tls.key {:?}: {e}",
                cfg.cert, cfg.key
            )),
        })?;
        Ok(material)
    }

    /// The subject CN of this instance's certificate.
    pub fn own_cn(&self) -> Option<String> {
        peer_cn(&self.certs[0])
    }

    /// Hub side: requires a client certificate issued by the CA.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, rustls::Error> {
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        let cfg = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(self.versions)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.certs.clone(), self.key.clone_key())?;
        Ok(Arc::new(cfg))
    }

    /// Gateway side: asks for a client certificate issued by the CA but also
    /// accepts clients without one (they authenticate with a bearer token);
    /// speaks HTTP/1.1.
    pub fn gateway_server_config(&self) -> Result<Arc<ServerConfig>, rustls::Error> {
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider())
            .allow_unauthenticated()
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        let mut cfg = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(self.versions)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.certs.clone(), self.key.clone_key())?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }

    /// Client side: verifies the hub against the CA and presents our certificate.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, rustls::Error> {
        let cfg = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(self.versions)?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.certs.clone(), self.key.clone_key())?;
        Ok(Arc::new(cfg))
    }

    /// Logs a warning for the instance certificate (read from `cert_path`)
    /// and the CA certificate (`ca_path`) expiring within `days`, naming the
    /// file and the certificate's CN.
    pub fn warn_expiry(&self, days: i64, cert_path: &str, ca_path: &str) {
        let horizon = unix_now() + days * 86_400;
        let check = |what: &str, path: &str, der: &CertificateDer<'_>| {
            if let Some((_, not_after)) = validity(der) {
                if not_after < horizon {
                    let cn = peer_cn(der).unwrap_or_default();
                    log::warn!(
                        "{what} certificate {path} (CN={cn}) expires within {days} days, on {} \
                         (not after); make a new one with keyop-messenger keygen",
                        iso8601(not_after)
                    );
                }
            }
        };
        check("instance", cert_path, &self.certs[0]);
        if let Ok(mut it) = CertificateDer::pem_file_iter(ca_path) {
            if let Some(Ok(ca)) = it.next() {
                check("CA", ca_path, &ca);
            }
        }
    }
}

/// A TLS configuration replaceable while running ([`super::Federation::reload_tls`]):
/// read once per accept or dial, so new connections use the newest one and
/// established connections keep the one they were made with.
pub struct Reloadable<T>(RwLock<Arc<T>>);

impl<T> Reloadable<T> {
    /// A holder starting with `config`.
    pub fn new(config: Arc<T>) -> Arc<Reloadable<T>> {
        Arc::new(Reloadable(RwLock::new(config)))
    }

    /// The configuration for the next connection.
    pub fn current(&self) -> Arc<T> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the configuration for connections made from now on.
    pub fn replace(&self, config: Arc<T>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = config;
    }
}

/// Subject common name of a DER certificate.
/// The CN of the certificate a client configuration presents.
pub fn own_cn(cfg: &ClientConfig) -> Option<String> {
    let schemes = cfg
        .crypto_provider()
        .signature_verification_algorithms
        .supported_schemes();
    let key = cfg.client_auth_cert_resolver.resolve(&[], &schemes)?;
    peer_cn(key.cert.first()?)
}

pub fn peer_cn(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_owned();
    Some(cn)
}

fn validity(der: &[u8]) -> Option<(i64, i64)> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let v = cert.validity();
    Some((v.not_before.timestamp(), v.not_after.timestamp()))
}

fn subject_of(der: &[u8]) -> Option<Vec<u8>> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(cert.subject().as_raw().to_vec())
}

fn issuer_of(der: &[u8]) -> Option<Vec<u8>> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(cert.issuer().as_raw().to_vec())
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// A Unix time as an ISO 8601 (RFC 3339) UTC date and time.
fn iso8601(secs: i64) -> String {
    crate::keygen::rfc3339(secs)
}

/// Refuses a certificate outside its validity window, giving the window in
/// ISO 8601 and the command that makes a new one.
fn check_validity(
    what: &str,
    path: &str,
    der: &[u8],
    now: i64,
    remedy: &str,
) -> Result<(), FedError> {
    let (not_before, not_after) = validity(der).ok_or_else(|| {
        tls_err(
            "unparsable certificate in",
            path,
            "not an X.509 certificate",
        )
    })?;
    let window = format!(
        "valid from {} until {}; now is {}",
        iso8601(not_before),
        iso8601(not_after),
        iso8601(now)
    );
    if now < not_before {
        return Err(FedError::Tls(format!(
            "{what} {path:?} is not yet valid ({window}): check the system clock, or issue a \
             new certificate with `keyop-messenger {remedy}`"
        )));
    }
    if now > not_after {
        return Err(FedError::Tls(format!(
            "{what} {path:?} has expired ({window}): issue a new certificate with \
             `keyop-messenger {remedy}`"
        )));
    }
    Ok(())
}

/// Refuses a private key file that group or others may access, and one that
/// is encrypted (passphrase-protected keys are not supported).
fn check_key_file(path: &str) -> Result<(), FedError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(path)
            .map_err(|e| tls_err("cannot read tls.key", path, e))?
            .permissions()
            .mode()
            & 0o777;
        if mode & 0o077 != 0 {
            return Err(FedError::Tls(format!(
                "tls.key {path:?} is readable or writable by group or others (mode {mode:04o}); \
                 a private key must be private to its owner: run `chmod 600 {path}`"
            )));
        }
    }
    let pem = std::fs::read(path).map_err(|e| tls_err("cannot read tls.key", path, e))?;
    if is_encrypted_pem(&pem) {
        return Err(FedError::Tls(format!(
            "tls.key {path:?} is encrypted (passphrase-protected), which is not supported: \
             write a decrypted copy with `openssl pkey -in {path} -out {path}.plain` (it asks \
             for the passphrase), then `chmod 600 {path}.plain` and point tls.key at it"
        )));
    }
    Ok(())
}

/// True for a PKCS #8 `ENCRYPTED PRIVATE KEY` block or a traditional PEM key
/// with an `ENCRYPTED` Proc-Type header.
fn is_encrypted_pem(pem: &[u8]) -> bool {
    let text = String::from_utf8_lossy(pem);
    text.contains("-----BEGIN ENCRYPTED PRIVATE KEY-----")
        || text
            .lines()
            .any(|l| l.starts_with("Proc-Type:") && l.contains("ENCRYPTED"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encrypted_pem_is_recognised() {
        assert!(is_encrypted_pem(
            b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n"
        ));
        assert!(is_encrypted_pem(
            b"-----BEGIN EC PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-256-CBC,00\n\nMIIB\n-----END EC PRIVATE KEY-----\n"
        ));
        assert!(!is_encrypted_pem(
            b"-----BEGIN EC PRIVATE KEY-----\nMIIB\n-----END EC PRIVATE KEY-----\n"
        ));
    }

    #[test]
    fn iso_dates() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00Z");
    }
}
