//! Helpers shared by the integration tests: each test file that uses them
//! declares `mod common;` and takes the subset it needs.
#![allow(dead_code)]

use std::path::Path;

use keyop_core::federation::TlsSettings;
use keyop_core::keygen::CertificateAuthority;
use keyop_core::storage::Item;
use keyop_core::{read_channel, Engine, Envelope, Error, Outgoing, StoreConfig};

/// An engine of origin `node` on `data_dir`, with the store's default
/// segment size (`sync_interval_ms` 0: every publish is fdatasynced).
pub fn open_engine(data_dir: &Path, sync_interval_ms: u64) -> Result<Engine, Error> {
    Engine::open(
        StoreConfig {
            data_dir: data_dir.to_owned(),
            sync_interval_ms,
            segment_bytes: 0,
        },
        "node",
    )
}

/// A message of type `test.T` with `json` as its payload.
pub fn msg(json: &str) -> Outgoing<'_> {
    Outgoing {
        payload_type: "test.T",
        payload_json: json.as_bytes(),
        service_name: None,
        correlation_id: None,
    }
}

/// The ids of the records stored in `channel`, in order.
pub fn ids_on_disk(data_dir: &Path, channel: &str) -> Vec<String> {
    let mut reader = read_channel(data_dir, channel, 0).expect("read channel");
    let mut ids = Vec::new();
    while let Some(item) = reader.next_item(u64::MAX).expect("read") {
        if let Item::Record { line, .. } = item {
            ids.push(Envelope::decode(&line).expect("valid record").id);
        }
    }
    ids
}

/// Writes a certificate for `name` (also valid for localhost and 127.0.0.1)
/// issued by `ca`, its key (0600) and the CA into `dir`; returns the TLS
/// settings naming them.
pub fn tls_files(dir: &Path, ca: &CertificateAuthority, ca_pem: &str, name: &str) -> TlsSettings {
    let extra = ["localhost".to_string(), "127.0.0.1".to_string()];
    let cert = ca.issue(name, &extra, 30).expect("issue");
    let (c, k, a) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
        dir.join("ca.crt"),
    );
    std::fs::write(&c, &cert.cert_pem).unwrap();
    std::fs::write(&k, &cert.key_pem).unwrap();
    // A key others can read is refused (as keygen writes them: 0600).
    std::fs::set_permissions(
        &k,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
    )
    .unwrap();
    std::fs::write(&a, ca_pem).unwrap();
    TlsSettings {
        cert: c.display().to_string(),
        key: k.display().to_string(),
        ca: a.display().to_string(),
        ..TlsSettings::default()
    }
}
