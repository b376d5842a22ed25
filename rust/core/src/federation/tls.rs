//! TLS for federation: rustls configurations for both roles, and the peer
//! identity (certificate subject CN).

use std::path::Path;
use std::sync::Arc;
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
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cfg.cert)
            .map_err(|e| tls_err("cannot read certificate", &cfg.cert, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| tls_err("bad PEM certificate in", &cfg.cert, e))?;
        if certs.is_empty() {
            return Err(tls_err(
                "no certificate in",
                &cfg.cert,
                "expected a CERTIFICATE PEM block",
            ));
        }
        let key = PrivateKeyDer::from_pem_file(&cfg.key)
            .map_err(|e| tls_err("no usable private key in", &cfg.key, e))?;
        let mut roots = RootCertStore::empty();
        let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cfg.ca)
            .map_err(|e| tls_err("cannot read CA file", &cfg.ca, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| tls_err("bad PEM certificate in", &cfg.ca, e))?;
        for ca in cas {
            roots
                .add(ca)
                .map_err(|e| tls_err("unusable CA certificate in", &cfg.ca, e))?;
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
        material.server_config().map_err(|e| {
            FedError::Tls(format!(
                "tls.cert {:?} and tls.key {:?}: {e}",
                cfg.cert, cfg.key
            ))
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

    /// Client side: verifies the hub against the CA and presents our certificate.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, rustls::Error> {
        let cfg = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(self.versions)?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.certs.clone(), self.key.clone_key())?;
        Ok(Arc::new(cfg))
    }

    /// Logs a warning for the instance and CA certificates expiring within `days`.
    pub fn warn_expiry(&self, days: i64, ca_path: &str) {
        let horizon = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0)
            + days * 86_400;
        let check = |what: &str, der: &[u8]| {
            if let Some(not_after) = not_after(der) {
                if not_after < horizon {
                    log::warn!("{what} certificate expires within {days} days (not after: unix {not_after})");
                }
            }
        };
        check("instance", &self.certs[0]);
        if let Ok(mut it) = CertificateDer::pem_file_iter(ca_path) {
            if let Some(Ok(ca)) = it.next() {
                check("CA", &ca);
            }
        }
    }
}

/// Subject common name of a DER certificate.
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

fn not_after(der: &[u8]) -> Option<i64> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(cert.validity().not_after.timestamp())
}
